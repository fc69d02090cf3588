"""What a weight sync is configured with (:class:`WeightSyncConfig`) and what one reports."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from grpo_nb.config import NonNegFloat, PosFloat, PosInt, check_fields

Transport = Literal["gloo", "reload", "nccl", "ipc"]
PauseMode = Literal["keep", "wait", "abort", "none"]
KVMode = Literal["keep", "recompute"]
EXTENSION = "grpo_nb.weight_sync.server_side.GrpoWorkerExtension"  # --worker-extension-cls
SendDtype = Literal["float32", "bfloat16", "float16"]
# The slowest rate a transfer's bytes are assumed to move at: a verified sync digests every byte
# on the worker (verify.digest: a copy to the CPU, then blake2b on one core), which ran at
# 0.2 GB/s on this project's 2-core CPU machine under load (a 64 MiB bf16 tensor); half that
# allows a slower host. 20 GB (≈ 10B parameters in bf16) is then given 200 s, not 20.
TRANSFER_BYTES_PER_S = 0.1e9


@dataclass
class WeightSyncConfig:
    """How weights travel to the server (:mod:`grpo_nb.weight_sync.syncer` runs a sync)."""

    transport: Transport = "gloo"  # CPU: gloo (our engine), reload (from disk); GPU: nccl, ipc
    # requests in flight: keep (frozen, continued on new weights), wait (drained), abort;
    # none: no /pause (CPU engines update between two steps); auto: LLMConfig.resolve picks
    # the ring's for the transport and device
    pause_mode: PauseMode | Literal["auto"] = "keep"
    # requests decoding when a sync lands: keep (they go on over the KV the old weights computed,
    # so their later tokens come from new weights attending to stale keys and values) or
    # recompute (the sync aborts them and the sampler resubmits prompt + the tokens they made,
    # llm/rollouts.generate: every later token over KV the new weights computed); with
    # pause_mode none or keep
    kv: KVMode = "keep"
    verify: bool = True  # check that the server received exactly the trainer's weights
    send_dtype: SendDtype | None = None  # what tensors travel (and are checked) in; None: the server's
    # bounds each control-plane HTTP call (pause, RPCs, the version); what a transfer's time
    # grows with (the weight-update calls, the transfer group, a reload's load, the send as a
    # whole) gets transfer_timeout(bytes) instead: this, or longer for a large model
    timeout_s: PosFloat = 20.0
    atol: NonNegFloat = 1e-3  # what the teaching probe (weight_gap) is read against; verify is exact
    probe_batch: PosInt = 4  # the probe's number of sequences
    probe_len: PosInt = 32  # and their length

    def __post_init__(self) -> None:
        check_fields(self)
        if self.pause_mode == "none" and self.transport not in ("gloo", "reload"):
            raise ValueError(f"WeightSyncConfig.pause_mode='none' needs a CPU transport "
                             f"('gloo' or 'reload'), not {self.transport!r}: only vLLM's CPU "
                             "engine surely runs the update between two steps (use 'keep')")
        if self.kv == "recompute" and self.pause_mode in ("wait", "abort"):
            raise ValueError(f"WeightSyncConfig.kv='recompute' needs pause_mode 'none' or 'keep', "
                             f"not {self.pause_mode!r}: with 'abort' the sampler resamples a cut "
                             "group, with 'wait' no request runs at a sync")

    def transfer_timeout(self, nbytes: int) -> float:
        """Seconds one transfer of ``nbytes`` may take: ``timeout_s``, or ``nbytes`` at
        :data:`TRANSFER_BYTES_PER_S` where that is longer (a large model)."""
        return max(self.timeout_s, nbytes / TRANSFER_BYTES_PER_S)

    def server_settings(self) -> dict[str, Any]:
        """The ``serving.ServerConfig`` fields the server needs for this transport."""
        backend = None if self.transport == "reload" else {"backend": self.transport}
        settings: dict[str, Any] = {"worker_extension_cls": EXTENSION,
                                    "weight_transfer_config": backend, "dev_mode": True}
        if self.transport == "ipc":  # CUDA-IPC handles travel pickled over HTTP
            settings["env"] = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
        return settings


@dataclass
class SyncResult:
    """What one sync did; ``phases``: milliseconds per step (``pause``, ``transfer``, …)."""

    version: int  # now served
    ms: float
    bytes: int  # every parameter in the send dtype
    verified: bool | None  # None: not checked
    phases: dict[str, float] = field(default_factory=dict)
    round_trips: int = 0  # HTTP calls of the sync (verification not included)
    # changed tensors seen applied in the served parameters since the last verified sync
    # (None: not checked; WeightSyncer.verify)
    applied: int | None = None


class Phases(dict):
    """``with phases("pause"): …`` adds the block's milliseconds under that name."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + (time.perf_counter() - t) * 1e3


def model_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of every parameter, in its own dtype or in ``dtype`` (what a sync sends)."""
    return sum(p.numel() * (dtype.itemsize if dtype else p.element_size())
               for p in model.parameters())
