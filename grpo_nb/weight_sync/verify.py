"""Exact proof that a sync landed: digests (dtype, shape, bytes) of what the server model's
``load_weights`` received, against the trainer's tensors (served parameters are repacked);
and that it was applied: the served parameters' own checksums (vLLM's ``/weight_checker``)
moved wherever the trainer's tensors did."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from grpo_nb.serving.control import WeightSyncError


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
    """What a sync sends: every parameter once, cast to ``dtype`` on the trainer."""
    for name, p in model.named_parameters():
        yield name, _full(p).to(dtype)


def expected_digests(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """The digest the server must have recorded for each parameter (read from the model, not
    the send path, so a faulty send cannot change what is expected)."""
    return {name: digest(_full(p).to(dtype)) for name, p in model.named_parameters()}


def compare(expected: dict[str, str], received: list[list[str]] | None) -> str | None:
    """Why the server's record of the last update differs from ``expected`` (None: equal)."""
    if received is None:
        return ("the server recorded no digests of the last update (verify() checks the update "
                "of a sync made with verify=True)")
    seen = dict(received)
    twice = [name for name, n in Counter(name for name, _ in received).items() if n > 1]
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


# sha256 of no bytes: a served parameter emptied after loading, its kernel holding a packed copy
# (vLLM's CPU linear layers: dispatch_cpu_unquantized_gemm(remove_weight=True)): not checkable.
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def served_targets(sent: Iterable[str], live: Mapping[str, str],
                   packed: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """For each sent tensor, the ``/weight_checker`` keys (``dp0:pp0:pcp0:tp0:<name>``, one per
    worker) of the served parameters it is loaded into: its own name, else its fused module's
    (``packed``: ``qkv_proj`` ← ``q_proj``, …); ``[]`` when the served model has neither."""
    keys: dict[str, list[str]] = {}
    for key in live:
        keys.setdefault(key.rpartition(":")[2], []).append(key)
    fused = {part: whole for whole, parts in packed.items() for part in parts}
    out = {}
    for name in sent:
        module, _, leaf = name.rpartition(".")
        parent, _, sub = module.rpartition(".")
        names = [name] + ([f"{parent}.{fused[sub]}.{leaf}".lstrip(".")] if sub in fused else [])
        out[name] = next((keys[n] for n in names if n in keys), [])
    return out


def unapplied(sent_then: Mapping[str, str], sent_now: Mapping[str, str],
              live_then: Mapping[str, str], live_now: Mapping[str, str],
              targets: Mapping[str, list[str]]) -> tuple[str | None, int]:
    """Between two verified syncs (``then``, ``now``: the trainer's digests and the served
    checksums after each): every sent tensor whose bytes changed must have changed some served
    parameter it is loaded into (a fused one moves when any of its parts does: it shows that
    one part landed, not each). Returns (why not, or None; how many changed tensors were
    checked: those loaded into a served parameter that holds its bytes)."""
    stuck, checked = [], 0
    for name, digest_now in sent_now.items():
        if sent_then.get(name, digest_now) == digest_now:
            continue  # unchanged (or new): nothing to see
        keys = [k for k in targets.get(name, [])
                if k in live_then and live_now.get(k, EMPTY_SHA256) != EMPTY_SHA256]
        if not keys:
            continue
        checked += 1
        if all(live_then[k] == live_now[k] for k in keys):
            stuck.append(name)
    if not stuck:
        return None, checked
    return (f"{len(stuck)} of {checked} changed tensors left the served parameters unchanged "
            f"(received, not applied): {', '.join(stuck[:3])}{' …' if len(stuck) > 3 else ''}",
            checked)


class Proof:
    """Verification of one server across syncs: what :meth:`check` asks the server once (its
    dtype, its fused modules) and the baseline it compares the next verified sync with."""

    def __init__(self, send_dtype: str | None, timeout_s: float) -> None:
        self.send_dtype, self.timeout_s = send_dtype, timeout_s
        # after the last verified sync: the trainer's digests and the served checksums
        self.served: tuple[dict[str, str], dict[str, str]] | None = None
        self.packed: dict[str, list[str]] | None = None  # the served model's fused modules
        self.casts: bool | None = None  # the server casts what it loads (send_dtype differs)
        self.applied: int | None = None  # changed tensors the last check saw applied

    def check(self, records: list[Any], client: Any, model: torch.nn.Module,
              dtype: torch.dtype, limit: float) -> None:
        """Raise :class:`WeightSyncError` unless every worker's ``records`` (digests of what
        ``load_weights`` was handed) equal the trainer's tensors, and the update landed: vLLM's
        ``/weight_checker`` checksums of the served parameters, against those after the previous
        check, differ wherever the sent digests do (the first check only records them; not
        checked when ``send_dtype`` is not the server's: its cast may round a change away)."""
        expected = expected_digests(model, dtype)
        for rank, received in enumerate(records or [None]):
            problem = compare(expected, received)
            if problem is not None:
                where = f" (worker {rank})" if len(records) > 1 else ""
                raise WeightSyncError(f"served weights differ from the trainer's{where}: "
                                      f"{problem}")
        self.applied = None
        if self.casts is None:
            self.casts = self.send_dtype is not None and self.send_dtype not in (
                client.collective_rpc("grpo_model_dtype", timeout=self.timeout_s))
        if self.casts:
            return
        live = client.weight_checksums(timeout=limit)
        if self.packed is None:
            answers = client.collective_rpc("grpo_packed_modules", timeout=self.timeout_s)
            self.packed = answers[0] if answers else {}
        if self.served is not None:
            then_sent, then_live = self.served
            targets = served_targets(expected, live, self.packed)
            problem, self.applied = unapplied(then_sent, expected, then_live, live, targets)
            if problem is not None:  # the baseline stays: a re-sync is compared with it again
                raise WeightSyncError(f"served parameters did not change where the trainer's "
                                      f"did since the last verified sync: {problem}")
        self.served = (expected, live)
