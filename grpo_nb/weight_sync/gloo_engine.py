"""A CPU weight-transfer engine for vLLM: gloo broadcast of packed byte buffers.

vLLM 0.32's engines (``nccl``, ``ipc``, …) all need CUDA. This module adds a ``gloo`` engine to
vLLM's two registries — the worker side (``WeightTransferEngineFactory``) and the trainer side
(``WeightTransferTrainerFactory``) — so the *same* vLLM flow drives it::

    trainer process (rank 0)                         vLLM worker process (rank 1)
    ───────────────────────                          ───────────────────────────
    GlooTrainerEngine.trainer_init ──HTTP /init_weight_transfer_engine──► GlooEngine.init
          └──────────── stateless gloo process group (TCP store) ─────────────┘
    send_weights():
      /start_weight_update ─────────────────────────► initialize_layerwise_reload(model)
      /update_weights {names, dtypes, shapes, chunks} ► receive_weights: for each chunk
      pack params → uint8 chunk ══ gloo broadcast ══►   unpack → model.load_weights(...)
      /finish_weight_update {weight_version} ───────► finalize_layerwise_reload(model)

The worker imports this module through ``--worker-extension-cls
grpo_nb.weight_sync.worker.GrpoWorkerExtension`` (importing registers the engine) and
``--weight-transfer-config '{"backend": "gloo"}'`` selects it. Chunks are padded so every
tensor starts at a 16-byte boundary, which lets the worker view its bytes as the right dtype
without a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

BACKEND = "gloo"
ALIGN = 16
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
_register_lock = threading.Lock()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_chunks(meta: list[ParamMeta], chunk_bytes: int) -> list[int]:
    """Byte size of each chunk when ``meta``'s tensors are packed in order (aligned).

    A tensor larger than ``chunk_bytes`` gets a chunk of its own; tensors are never split, so
    the worker can hand whole tensors to ``load_weights``.
    """
    sizes: list[int] = []
    current = 0
    for m in meta:
        n = _aligned(torch.Size(m.shape).numel() * m.dtype.itemsize)
        if current and current + n > chunk_bytes:
            sizes.append(current)
            current = 0
        current += n
    if current:
        sizes.append(current)
    return sizes


def _open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo process group that leaves torch.distributed's global state alone."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend="gloo", timeout=timedelta(seconds=timeout_s)
    )


def _broadcast(group: Any, buf: torch.Tensor) -> None:
    # ProcessGroup.broadcast takes the *group* rank as root, unlike dist.broadcast.
    group.broadcast(buf, 0).wait()


# ── worker side (inside the vLLM server) ───────────────────────────────────────────────────


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What the worker needs to join the trainer's gloo group."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 120.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: every tensor's name, dtype and shape, and the byte size of each chunk."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    chunk_bytes: list[int]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError("GlooUpdateInfo: names, dtype_names and shapes differ in length")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker-side engine: receives packed chunks and loads them with ``model.load_weights``."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:  # noqa: ANN001 (vLLM's)
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a trainer that reconnects replaces its previous group
        rank = self.parallel_config.rank + init_info.rank_offset
        self.group = _open_group(init_info.master_address, init_info.master_port, rank,
                                 init_info.world_size, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which fails on a CPU-only
        # worker; gloo's broadcast has completed when wait() returns, so nothing to sync.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call "
                               "/init_weight_transfer_engine first")
        entries = iter(zip(update_info.names, update_info.dtype_names, update_info.shapes,
                           strict=True))
        pending = next(entries, None)
        for size in update_info.chunk_bytes:
            buf = torch.empty(size, dtype=torch.uint8)
            _broadcast(self.group, buf)
            offset, batch = 0, []
            while pending is not None:
                name, dtype_name, shape = pending
                dtype = getattr(torch, dtype_name)
                nbytes = torch.Size(shape).numel() * dtype.itemsize
                if offset + nbytes > size:
                    break
                batch.append((name, buf[offset:offset + nbytes].view(dtype).view(shape)))
                offset = _aligned(offset + nbytes)
                pending = next(entries, None)
            self.model.load_weights(batch)
        if pending is not None:
            raise RuntimeError(f"gloo weight transfer: chunks ended before {pending[0]!r}")

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None


# ── trainer side ───────────────────────────────────────────────────────────────────────────


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: where the TCP store listens, and the chunk size on the wire."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int = 2
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout_s: float = 120.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer-side engine: packs the source's tensors into chunks and broadcasts them."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource,
                 is_sender: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.chunk_bytes = chunk_bytes
        self.group: Any = None
        self.weight_version: str | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     chunk_bytes=init_info.chunk_bytes)
        worker_info = GlooInitInfo(init_info.master_address, init_info.master_port,
                                   init_info.world_size, rank_offset=1,
                                   timeout_s=init_info.timeout_s)
        # The worker blocks in the rendezvous until we join too: run its RPC on a thread.
        with ThreadPoolExecutor(max_workers=1) as pool:
            rpc = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            try:
                engine.group = _open_group(init_info.master_address, init_info.master_port, 0,
                                           init_info.world_size, init_info.timeout_s)
            finally:
                rpc.result()  # surface the server's error (e.g. unknown backend) first
        return engine

    def send_weights(self) -> None:
        """One full round trip: start, update (concurrent with our broadcast), finish."""
        assert self.source is not None and self.group is not None
        meta = self.source.metadata()
        chunks = plan_chunks(meta, self.chunk_bytes)
        info = GlooUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
            chunk_bytes=chunks,
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            rpc = pool.submit(self.client.update_weights, asdict(info))
            for buf in pack_chunks(self.source, meta, chunks):
                if rpc.done():  # the server refused: do not wait for a peer that never comes
                    rpc.result()
                    raise RuntimeError("server's update_weights returned before all chunks")
                _broadcast(self.group, buf)
            rpc.result()
        finally:
            # On error the worker may be stuck in a broadcast until gloo's timeout; never join.
            pool.shutdown(wait=False)
        self.client.finish_weight_update(self.weight_version)

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None


def pack_chunks(source: WeightSource, meta: list[ParamMeta],
                chunks: list[int]) -> Iterator[torch.Tensor]:
    """Yield one uint8 buffer per planned chunk, tensors laid out as :func:`plan_chunks` says."""
    pairs = iter(source)
    index = 0
    for size in chunks:
        buf = torch.zeros(size, dtype=torch.uint8)
        offset = 0
        while index < len(meta):
            m = meta[index]
            nbytes = torch.Size(m.shape).numel() * m.dtype.itemsize
            if offset + nbytes > size:
                break
            name, tensor = next(pairs)
            if name != m.name or tuple(tensor.shape) != tuple(m.shape):
                raise ValueError(f"weight source changed under us: {name!r} vs {m.name!r}")
            flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
            buf[offset:offset + nbytes].copy_(flat)
            offset = _aligned(offset + nbytes)
            index += 1
        yield buf
    if index != len(meta):
        raise ValueError(f"packed {index} of {len(meta)} tensors: chunk plan is wrong")


def register() -> None:
    """Add the ``gloo`` engine to both vLLM registries (idempotent)."""
    with _register_lock:
        if BACKEND not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
        if BACKEND not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(BACKEND,
                                                         GlooTrainerWeightTransferEngine)
