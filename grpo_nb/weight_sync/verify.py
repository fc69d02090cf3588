"""Exact proof that a sync landed: per-tensor digests of what the server model's
``load_weights`` (every transport's last step) received, recorded by
:mod:`grpo_nb.weight_sync.worker`, against the trainer's tensors. The served parameters cannot
be compared (vLLM fuses and repacks them). A digest hashes dtype, shape and raw bytes: a
skipped, stale, wrongly cast or single-bit-flipped tensor fails, in every dtype.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch


def digest(tensor: torch.Tensor) -> str:
    """blake2b of a tensor's dtype, shape and bytes (any device; copied to the CPU)."""
    t = tensor.detach()
    h = hashlib.blake2b(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}".encode(),
                        digest_size=16)
    h.update(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _full(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)  # a sharded parameter, gathered
    return (full() if callable(full) else p).detach()


def sent_tensors(model: torch.nn.Module, dtype: torch.dtype
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sync sends: every parameter once (a tied weight under its first name), cast to
    ``dtype`` on the trainer (a copy only when the dtype differs)."""
    for name, p in model.named_parameters():
        yield name, _full(p).to(dtype)


def expected_digests(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """The digest the server must have recorded for each parameter. Read from the model, not
    from :func:`sent_tensors`: a send path that drops or alters a tensor must not change what
    the check expects."""
    return {name: digest(_full(p).to(dtype)) for name, p in model.named_parameters()}


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
