"""A CPU weight-transfer engine for vLLM: one gloo broadcast per tensor, loaded as it lands.

vLLM 0.32's engines (``nccl``, ``ipc``, …) all need CUDA. This module adds a ``gloo`` engine to
vLLM's two registries — the worker side (``WeightTransferEngineFactory``) and the trainer side
(``WeightTransferTrainerFactory``) — so the same vLLM init flow drives it::

    trainer process (rank 0)                          vLLM worker process (rank 1)
    ───────────────────────                           ───────────────────────────
    GlooTrainerEngine.trainer_init ──HTTP /init_weight_transfer_engine──► GlooEngine.init
          └──────── gloo group on 127.0.0.1 (gloo_group.py) ───────────────┘
    send_weights():  ONE HTTP call per sync
      POST /collective_rpc grpo_gloo_sync(names, dtypes, shapes) ─► start_weight_update
      broadcast every parameter straight from          post every receive at once into a
      its own storage (no packing copy)  ═══ gloo ═══► persistent buffer (one slot a tensor);
                                                       load layer k while k+1.. still arrive
      ◄──────────────── server timings (start, wait, load, finish) ── finish_weight_update

Why it is fast: no packing on the trainer, no allocation on the worker after the first sync,
receive overlapped with ``load_weights``, and start / update / finish folded into one RPC (the
engine core runs it as one step, so no forward pass can see a half-loaded model).
Slots are 16-byte aligned so each is viewed as its dtype without a copy. The worker keeps the
receive buffer (one copy of the weights) for the server's lifetime.

Bounds: both ranks' group has a timeout (``timeout_s``), so a receive or send waiting on a
silent peer fails; the trainer's wait on its sends has the same deadline, and the syncer gives
up on a whole transfer shortly after (a trainer stalled mid-send). Closing a group aborts its
sockets, so the peer's pending operations fail at once rather than at the timeout.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
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

from grpo_nb.weight_sync.gloo_group import close_group, listen_loopback, open_group

BACKEND = "gloo"
ALIGN = 16
SYNC_METHOD = "grpo_gloo_sync"  # the worker-extension method (worker.py) that runs one sync
STATUS_OK, STATUS_ABORTED = 1, 0  # the last broadcast of a sync: did the trainer send it all?
_register_lock = threading.Lock()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the receive buffer (16-byte aligned), and its size."""
    offsets, total = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        offsets.append(total)
        total = _aligned(total + torch.Size(shape).numel() * dtype.itemsize)
    return offsets, total


def layer_key(name: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` → ``model.layers.3``: tensors loaded together.

    vLLM processes a layer (fuses q/k/v, repacks for its CPU kernels) once all its tensors are
    in, so handing it a whole decoder block per call costs no extra buffering.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return name


def refresh_tied_heads(model: torch.nn.Module) -> int:
    """Rebuild the kernel state of every output head tied to the input embedding.

    vLLM's layerwise reload processes a layer when its own weights arrive. A tied ``lm_head``
    gets none (the shared tensor arrives once, as ``embed_tokens.weight``), so
    ``finalize_layerwise_processing`` only puts the shared, updated tensor back and never
    re-runs ``process_weights_after_loading``: on CPU, the oneDNN handler that step built holds
    its own packed copy of the weight, and the logits keep coming from the weights the server
    started with. Returns how many heads it rebuilt.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    inputs = {id(m.weight) for m in model.modules()
              if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    heads = [m for m in model.modules()
             if isinstance(m, ParallelLMHead) and id(m.weight) in inputs]
    for head in heads:
        if not isinstance(head.quant_method, UnquantizedEmbeddingMethod):
            # Re-processing would quantize a quantized weight again; serving stale logits
            # silently would be worse than refusing.
            raise RuntimeError(f"a tied lm_head with {type(head.quant_method).__name__} cannot "
                               "be rebuilt after a weight update")
        head.quant_method.process_weights_after_loading(head)
    return len(heads)


# ── worker side (inside the vLLM server) ───────────────────────────────────────────────────


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What the worker needs to join the trainer's gloo group (always on loopback)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 120.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: every tensor's name, dtype and shape, in the order they are broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError("GlooUpdateInfo: names, dtype_names and shapes differ in length")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker-side engine: receives every tensor into a persistent buffer, loads per layer."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:  # noqa: ANN001 (vLLM's)
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.buffer: torch.Tensor | None = None
        self.last_timings: dict[str, float] = {}

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a trainer that reconnects replaces its previous group
        rank = self.parallel_config.rank + init_info.rank_offset
        self.group = open_group(rank, init_info.world_size, init_info.timeout_s,
                                port=init_info.master_port, host=init_info.master_address)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_heads(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which fails on a CPU-only
        # worker; every receive has been waited on when receive_weights returns.
        self.receive_weights(self.parse_update_info(update_info))

    def _slots(self, info: GlooUpdateInfo) -> list[torch.Tensor]:
        dtypes = [getattr(torch, name) for name in info.dtype_names]
        offsets, total = plan_layout(dtypes, info.shapes)
        if self.buffer is None or self.buffer.numel() != total:
            self.buffer = torch.empty(total, dtype=torch.uint8)
        return [self.buffer[o:o + torch.Size(s).numel() * d.itemsize]
                for o, s, d in zip(offsets, info.shapes, dtypes, strict=True)]

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call "
                               "/init_weight_transfer_engine first")
        slots = self._slots(update_info)
        # Post every receive now: gloo's threads fill the slots while this thread loads.
        works = [self.group.broadcast(slot, 0) for slot in slots]
        status = torch.zeros(1, dtype=torch.int32)
        status_work = self.group.broadcast(status, 0)
        wait_s = load_s = 0.0
        batch: list[tuple[str, torch.Tensor]] = []
        entries = zip(update_info.names, update_info.dtype_names, update_info.shapes,
                      slots, works, strict=True)
        for i, (name, dtype_name, shape, slot, work) in enumerate(entries):
            t = time.perf_counter()
            work.wait()
            wait_s += time.perf_counter() - t
            batch.append((name, slot.view(getattr(torch, dtype_name)).view(shape)))
            last = i + 1 == len(slots)
            if last or layer_key(update_info.names[i + 1]) != layer_key(name):
                t = time.perf_counter()
                self.model.load_weights(batch)
                load_s += time.perf_counter() - t
                batch = []
        status_work.wait()
        if int(status.item()) != STATUS_OK:
            raise RuntimeError("the trainer aborted this weight transfer midway (its error is "
                               "raised there); the layers loaded so far hold partly new weights")
        self.last_timings = {"wait_ms": wait_s * 1e3, "load_ms": load_s * 1e3}

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            close_group(group, abort=True)


# ── trainer side ───────────────────────────────────────────────────────────────────────────


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: loopback only; the store's port is chosen when it binds."""

    backend: ClassVar[str] = BACKEND

    world_size: int = 2
    timeout_s: float = 120.0
    master_address: str = "127.0.0.1"


@dataclass
class SendReport:
    """Trainer-side view of one send, plus the worker's own timings (ms)."""

    send_ms: float = 0.0
    rpc_ms: float = 0.0
    server: dict[str, float] = field(default_factory=dict)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer-side engine: broadcasts each parameter from its own storage.

    ``client`` must offer ``collective_rpc`` (our ``VLLMControlClient`` does): the whole
    update is one call to the worker extension's ``grpo_gloo_sync``.
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource,
                 is_sender: bool = True, timeout_s: float = 120.0) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.timeout_s = timeout_s
        self.group: Any = None
        self.last = SendReport()
        # One long-lived thread for the update RPC: its HTTP connection stays open between syncs.
        self._rpc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-gloo-rpc")

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     timeout_s=init_info.timeout_s)
        sock = listen_loopback()
        worker_info = GlooInitInfo(init_info.master_address, sock.getsockname()[1],
                                   init_info.world_size, rank_offset=1,
                                   timeout_s=init_info.timeout_s)
        # The worker blocks in the rendezvous until we join too: run its RPC on a thread.
        with ThreadPoolExecutor(max_workers=1) as pool:
            rpc = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            try:
                engine.group = open_group(0, init_info.world_size, init_info.timeout_s,
                                          listen_socket=sock, host=init_info.master_address)
            except BaseException:
                sock.close()
                raise
            finally:
                rpc.result()  # surface the server's error (e.g. unknown backend) first
        return engine

    def send_weights(self, record: bool = False) -> None:
        """One sync: the worker's RPC runs concurrently with our broadcasts; ``record``: the
        worker digests every tensor it loads (the syncer's exact verification)."""
        assert self.source is not None and self.group is not None
        meta = self.source.metadata()
        info = GlooUpdateInfo(names=[m.name for m in meta],
                              dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                              shapes=[list(m.shape) for m in meta])
        start = time.perf_counter()
        works: list[Any] = []
        try:
            rpc = self._rpc_pool.submit(self.client.collective_rpc,  # type: ignore[attr-defined]
                                        SYNC_METHOD, {"update_info": asdict(info),
                                                      "record": record}, self.timeout_s)
            t_send = time.perf_counter()
            failure = self._post_sends(meta, works)
            _wait_all(works, rpc, time.monotonic() + self.timeout_s)
            send_ms = (time.perf_counter() - t_send) * 1e3
            works.clear()
            if failure is not None:
                with contextlib.suppress(Exception):  # the worker reports "aborted": ours is
                    rpc.result()                      # the cause worth raising
                raise failure
            results = rpc.result()
        except BaseException:
            # Close our sockets so the worker's pending receives fail now, not at the timeout.
            self.shutdown()
            raise
        server = results[0] if results and isinstance(results[0], dict) else {}
        self.last = SendReport(send_ms, (time.perf_counter() - start) * 1e3, server)

    def _post_sends(self, meta: list[ParamMeta], works: list[Any]) -> Exception | None:
        """Post one broadcast per tensor, then the status word; return a trainer-side error.

        If reading a tensor fails midway, the rest go out as zeros and the status says
        "aborted": the worker, already waiting for them, then fails at once rather than at
        gloo's timeout (a closed socket is only noticed by receives already posted).
        """
        keep: list[torch.Tensor] = []  # sends read these asynchronously
        failure: Exception | None = None
        try:
            for m, (name, tensor) in zip(meta, self.source, strict=True):
                if name != m.name or tuple(tensor.shape) != tuple(m.shape):
                    raise ValueError(f"weight source changed under us: {name!r} vs {m.name!r}")
                # A view of the parameter's own storage: no copy unless on GPU or strided.
                flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
                keep.append(flat)
                works.append(self.group.broadcast(flat, 0))
        except Exception as err:
            failure = err
            sizes = [torch.Size(m.shape).numel() * m.dtype.itemsize for m in meta[len(works):]]
            zeros = torch.zeros(max(sizes, default=0), dtype=torch.uint8)
            works.extend(self.group.broadcast(zeros[:n], 0) for n in sizes)
            keep.append(zeros)
        status = torch.tensor([STATUS_ABORTED if failure else STATUS_OK], dtype=torch.int32)
        works.append(self.group.broadcast(status, 0))
        works.append(_KeepAlive([*keep, status]))
        return failure

    def shutdown(self) -> None:
        # Never join the RPC thread: after a failure it may still wait on a dead server.
        self._rpc_pool.shutdown(wait=False)
        if self.group is not None:
            group, self.group = self.group, None
            close_group(group, abort=True)


class _KeepAlive:
    """A finished pseudo-work that holds the tensors the real sends read from."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


def _wait_all(works: list[Any], rpc: Future, deadline: float) -> None:
    """Wait for every send; stop early if the worker's RPC fails first (it refused)."""
    for work in works:
        while not work.is_completed():
            if rpc.done():
                rpc.result()  # raises the server's error
                break  # it succeeded, so it received everything: our send is just late to say so
            if time.monotonic() > deadline:
                raise TimeoutError("gloo send did not complete before the timeout")
            time.sleep(0.0005)
        work.wait()  # raises a transport error (peer gone)


def register() -> None:
    """Add the ``gloo`` engine to both vLLM registries (idempotent)."""
    with _register_lock:
        if BACKEND not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
        if BACKEND not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(BACKEND,
                                                         GlooTrainerWeightTransferEngine)
