"""Exact proof that a sync landed: digests (dtype, shape, bytes) of what the server model's
``load_weights`` received, against the trainer's tensors (served parameters are repacked)."""

from __future__ import annotations

import hashlib
from collections import Counter
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
