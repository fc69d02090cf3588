"""Proof that a sync landed: exact per-tensor digests, and the log-prob probe that teaches it.

Exact verification (what :meth:`WeightSyncer.verify` does)::

    trainer                                          vLLM worker (worker.py)
    sent_tensors(model, dtype) ══ any transport ══►  model.load_weights(weights)
      name, p.to(dtype)                                └ wrapped while armed: digest(tensor)
    expected_digests(model, dtype)                       of every tensor it RECEIVES
            └─────────── compare ◄── /collective_rpc grpo_update_record ──┘

Every transport ends in the model's ``load_weights``: the gloo, NCCL and IPC engines call
``self.model.load_weights`` and ``reload_weights`` calls ``model.load_weights(iterator)``. The
model's parameters themselves cannot be compared: vLLM fuses q/k/v and gate/up and, on CPU,
repacks linear weights for its kernels after loading. A digest hashes the tensor's raw bytes
with its dtype and shape (blake2b), so equality is bitwise: a skipped tensor, a stale one, a
wrong dtype or a single flipped bit all fail, in every dtype; a sync that changed nothing
cannot pass by being "close". It proves every parameter reached the loader exactly once, in
the send dtype; that the loader then placed it right is what the probe below shows.

The probe (teaching, :meth:`WeightSyncer.weight_gap`): fixed token sequences scored by the
server (``prompt_logprobs``) and by the trainer; the largest gap. Float32 agrees to ~1e-5;
in bf16, vLLM's and HF's kernels round differently, so the gap is never zero and no tolerance
is both tight enough to catch a small update and loose enough never to fail a good sync.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from grpo_nb.weight_sync.client import VLLMControlClient, WeightSyncError


def digest(tensor: torch.Tensor) -> str:
    """blake2b of a tensor's dtype, shape and bytes (any device; copied to the CPU)."""
    t = tensor.detach()
    h = hashlib.blake2b(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}".encode(),
                        digest_size=16)
    h.update(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def sent_tensors(model: torch.nn.Module, dtype: torch.dtype
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sync sends: every parameter once (a tied weight under its first name), cast to
    ``dtype`` (a copy only when it differs); a sharded one gathered (``full_tensor``)."""
    for name, p in model.named_parameters():
        full = getattr(p, "full_tensor", None)
        yield name, (full() if callable(full) else p).detach().to(dtype)


def expected_digests(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """The digest the server must have recorded for each parameter of the trainer's model.

    Read from the model itself, not from :func:`sent_tensors`: a send path that drops or
    alters a tensor must not change what the check expects."""
    out = {}
    for name, p in model.named_parameters():
        full = getattr(p, "full_tensor", None)
        out[name] = digest((full() if callable(full) else p).detach().to(dtype))
    return out


def compare(expected: dict[str, str], received: list[list[str]] | None) -> str | None:
    """Why the server's record of the last update differs from ``expected`` (None: equal)."""
    if received is None:
        return ("the server recorded no digests of the last update (verify() checks the update "
                "of a sync made with verify=True)")
    seen: dict[str, str] = {}
    twice = []
    for name, d in received:
        if name in seen:
            twice.append(name)
        seen[name] = d
    missing = [name for name in expected if name not in seen]
    extra = [name for name in seen if name not in expected]
    differ = [name for name in expected if name in seen and seen[name] != expected[name]]
    problems = [f"{what} ({len(names)}): {', '.join(names[:3])}{' …' if len(names) > 3 else ''}"
                for what, names in (("not received", missing), ("not the trainer's", extra),
                                    ("received twice", twice), ("bytes differ", differ))
                if names]
    if not problems:
        return None
    return f"{len(received)} tensors received, {len(expected)} sent; " + "; ".join(problems)


# ── the log-prob probe (teaching) ──


def probe_ids(vocab: int, batch: int, length: int) -> list[list[int]]:
    """Fixed token sequences whose log-probs both sides compute (seeded)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


PROBE_TIMEOUT_S = 120.0  # a probe request may pay the sampler's first compile (see below)


def server_logprobs(client: VLLMControlClient, model_name: str,
                    ids: list[list[int]]) -> torch.Tensor:
    """``[N, L-1]`` log-probs the server assigns to each probe token given its prefix.

    The first request with log-probs a server serves compiles its sampler's
    ``batched_count_greater_than`` (``torch.compile``, even with ``--enforce-eager``), which takes
    tens of seconds on a busy 2-core machine with a cold compile cache. So a probe request waits up to
    ``PROBE_TIMEOUT_S`` (a dead server still fails at once: nothing accepts the connection).
    """
    rows = []
    for seq in ids:
        body: dict[str, Any] = {"model": model_name, "prompt": seq, "max_tokens": 1,
                                "temperature": 0.0, "prompt_logprobs": 0}
        choice = client.completions(body, timeout=max(client.timeout,
                                                      PROBE_TIMEOUT_S))["choices"][0]
        entries = choice.get("prompt_logprobs") or []
        if len(entries) != len(seq):
            raise WeightSyncError(f"server returned {len(entries)} prompt log-probs for a "
                                  f"{len(seq)}-token probe")
        rows.append([float(entries[i][str(tok)]["logprob"])
                     for i, tok in enumerate(seq) if i > 0])
    return torch.tensor(rows, dtype=torch.float64)


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, ids: list[list[int]],
                     dtype: torch.dtype) -> torch.Tensor:
    """The same log-probs from the trainer's model, run in the served ``dtype`` (autocast
    when the model holds float32 master weights and the server bf16)."""
    device = next(model.parameters()).device
    x = torch.tensor(ids, device=device)
    cast = dtype != torch.float32 and next(model.parameters()).dtype == torch.float32
    with torch.autocast(device.type, dtype=dtype, enabled=cast):
        logits = model(input_ids=x).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, x[:, 1:, None])
    return logp.squeeze(-1).double().cpu()
