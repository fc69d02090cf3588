"""What a weight sync is configured with (:class:`WeightSyncConfig`) and what it reports
(:class:`SyncResult`); the flow itself is :mod:`grpo_nb.weight_sync.syncer`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Transport = Literal["gloo", "reload", "nccl", "ipc"]
PauseMode = Literal["keep", "wait", "abort", "none"]
EXTENSION = "grpo_nb.weight_sync.worker.GrpoWorkerExtension"
SEND_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class WeightSyncConfig:
    """How weights travel to the server.

    Args:
        transport: ``gloo`` (CPU, our engine), ``reload`` (CPU, from disk), ``nccl`` (GPU,
            one per side) or ``ipc`` (GPU shared by trainer and server).
        pause_mode: what happens to in-flight requests during a sync (see
            :mod:`grpo_nb.weight_sync.syncer`).
        verify: after each sync, check that the server received exactly the trainer's weights
            (per-tensor digests, :mod:`grpo_nb.weight_sync.verify`) and serves the version.
        send_dtype: the dtype tensors travel (and are checked) in; ``None``: the server's own
            dtype, asked once. An fp32 trainer model syncs to a bf16 server as bf16.
        timeout_s: bounds every HTTP call, the process group, and each transfer as a whole;
            a stalled or dead peer fails the sync after at most this long.
        atol: the tolerance the log-prob probe (:meth:`WeightSyncer.weight_gap`, a teaching
            demonstration) is read against; ``verify`` is exact and does not use it.
        probe_batch / probe_len: size of that probe.
    """

    transport: Transport = "gloo"
    pause_mode: PauseMode = "keep"
    verify: bool = True
    send_dtype: str | None = None
    timeout_s: float = 20.0
    atol: float = 1e-3
    probe_batch: int = 4
    probe_len: int = 32

    def __post_init__(self) -> None:
        if self.transport not in ("gloo", "reload", "nccl", "ipc"):
            raise ValueError(f"WeightSyncConfig.transport={self.transport!r}: "
                             "use 'gloo', 'reload', 'nccl' or 'ipc'")
        if self.pause_mode not in ("keep", "wait", "abort", "none"):
            raise ValueError(f"WeightSyncConfig.pause_mode={self.pause_mode!r}: "
                             "use 'keep', 'wait', 'abort' or 'none'")
        if self.pause_mode == "none" and self.transport not in ("gloo", "reload"):
            raise ValueError(f"WeightSyncConfig.pause_mode='none' needs a CPU transport "
                             f"('gloo' or 'reload'), not {self.transport!r}: only vLLM's CPU "
                             "engine surely runs the update between two steps (use 'keep')")
        if self.send_dtype is not None and self.send_dtype not in SEND_DTYPES:
            raise ValueError(f"WeightSyncConfig.send_dtype={self.send_dtype!r}: use None (the "
                             f"server's dtype) or one of {', '.join(SEND_DTYPES)}")
        if self.timeout_s <= 0:
            raise ValueError(f"WeightSyncConfig.timeout_s={self.timeout_s}: must be > 0")

    @classmethod
    def smoke(cls) -> WeightSyncConfig:
        return cls()

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
    """What one sync did: the version now served, its duration and size, and the check.

    ``bytes`` counts what travelled (every parameter in the send dtype). ``phases`` holds
    milliseconds per phase: ``reset`` (after a failed sync: the server's update closed),
    ``pause``, ``transfer`` (trainer side: gloo sends / safetensors write), ``load`` (server
    side: ``load_weights`` / the reload RPC), ``finish`` (server side: layer processing after
    the last tensor; gloo), ``cache`` (``none``, unsalted: the prefix-cache reset),
    ``version``, ``resume`` and ``total``; gloo adds the server's ``start``, ``wait`` (blocked
    on the wire) and ``rpc`` (the update call seen by the trainer). ``round_trips`` counts the
    HTTP calls the sync made (verification not included).
    """

    version: int
    ms: float
    bytes: int
    verified: bool | None  # None: not checked
    phases: dict[str, float] = field(default_factory=dict)
    round_trips: int = 0


def model_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of every parameter, in its own dtype or in ``dtype`` (what a sync sends)."""
    return sum(p.numel() * (dtype.itemsize if dtype else p.element_size())
               for p in model.parameters())
