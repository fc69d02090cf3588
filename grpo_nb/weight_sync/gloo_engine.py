"""The trainer's side of vLLM's weight transfer: the gloo transport (vLLM's own engines need
CUDA), its loopback-only group and the trainer's engine, which posts a broadcast of each tensor,
then makes the one ``/collective_rpc`` that receives and loads them (server_side.py);
:func:`trainer_engine` for every transport, and :func:`beside`, the sync's one thread."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any, ClassVar

import torch

from grpo_nb.weight_sync import vllm_compat  # the version gate, before any vLLM name

# isort: split
from vllm.distributed.weight_transfer import base
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLWeightTransferUpdateInfo,
)

from grpo_nb.serving.net import LOOPBACK, free_port, is_loopback
from grpo_nb.weight_sync import verify

BACKEND = "gloo"
STATUS_OK, STATUS_ABORTED = 1, 0  # the last broadcast of a sync: did the trainer send it all?


def listen_loopback() -> socket.socket:
    """A listening socket on a free loopback port for rank 0's store (bound here: no race)."""
    return socket.create_server((LOOPBACK, 0), backlog=8)


def open_group(rank: int, world_size: int, timeout_s: float, *, port: int | None = None,
               listen_socket: socket.socket | None = None, host: str = LOOPBACK) -> Any:
    """Join a gloo group (blocks): rank 0 hosts the store on ``listen_socket``, others at port.
    Loopback only (the worker loads whatever arrives); torch.distributed's globals untouched."""
    if not is_loopback(host):
        raise ValueError(f"open_group(host={host!r}): the weight-transfer group is loopback-only")
    if listen_socket is not None:
        port = listen_socket.getsockname()[1]
    elif port is None:
        raise ValueError("open_group: pass listen_socket (rank 0) or port (other ranks)")
    return vllm_compat.gloo_group(rank, world_size, timedelta(seconds=timeout_s), host, port,
                                  listen_socket)


def close_group(group: Any) -> None:
    """Abort the group, so a peer blocked in a receive fails now, not at the timeout."""
    with contextlib.suppress(Exception):
        group.abort()


@dataclass
class GlooInitInfo(base.WeightTransferInitInfo):
    """What the worker needs to join the trainer's gloo group (always on loopback)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 120.0


class GlooUpdateInfo(NCCLWeightTransferUpdateInfo):
    """One update: every tensor's name, dtype and shape, in the order they are broadcast
    (the fields of vLLM's NCCL update, checked alike)."""


class SendSource(base.ModuleSource):
    """vLLM's ``ModuleSource`` with every tensor cast to ``dtype`` (the bytes digests check)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__(module)
        self.module, self.dtype = module, dtype

    def metadata(self) -> list[base.ParamMeta]:
        return [replace(m, dtype=self.dtype) for m in super().metadata()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return verify.sent_tensors(self.module, self.dtype)


@dataclass
class GlooTrainerInitInfo(base.TrainerInitInfo):
    """Trainer-side init info: two ranks on loopback, the store's port chosen as it binds."""

    backend: ClassVar[str] = BACKEND
    timeout_s: float = 120.0


def beside(fn: Callable[[], Any], name: str) -> Future:
    """``fn`` on a daemon thread of its own, the weight sync's only one: for a call that must
    run while the caller blocks (the rendezvous), or one its caller may abandon (a transfer:
    a CUDA call, or the trainer's own gather, can hang). Returns ``fn``'s :class:`Future`."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as err:  # handed to the waiting thread
            future.set_exception(err)

    threading.Thread(target=run, daemon=True, name=name).start()
    return future


class GlooTrainerWeightTransferEngine(base.TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Posts a broadcast of each parameter, then one ``collective_rpc`` runs the worker's
    receive; the RPC's answer says the worker has every tensor."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: base.VLLMWeightSyncClient, source: base.WeightSource,
                 timeout_s: float) -> None:
        super().__init__(client=client, source=source)  # the sender: rank 0 of two
        self.timeout_s = timeout_s
        self.group: Any = None
        self.last: dict[str, float] = {}  # the last send's server-side timings in ms

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: base.VLLMWeightSyncClient,
                     source: base.WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        engine = cls(client=client, source=source, timeout_s=init_info.timeout_s)
        sock = listen_loopback()
        worker_info = GlooInitInfo(LOOPBACK, sock.getsockname()[1], 2, rank_offset=1,
                                   timeout_s=init_info.timeout_s)
        # The worker blocks in the rendezvous until we join too: its RPC runs beside us.
        rpc = beside(lambda: client.init_weight_transfer_engine(asdict(worker_info)),
                     "grpo-gloo-join")
        try:
            engine.group = open_group(0, 2, init_info.timeout_s, listen_socket=sock)
        finally:
            rpc.result()  # surface the server's error (e.g. unknown backend) first
        return engine

    def send_weights(self, record: bool = False) -> None:
        """One sync; ``record``: the worker digests every tensor it loads. The broadcasts are
        posted first (gloo's threads send them as the worker receives), then the RPC blocks
        until the worker has received and loaded them all, or refused."""
        assert self.source is not None and self.group is not None
        meta = self.source.metadata()
        info = GlooUpdateInfo(names=[m.name for m in meta],
                              dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                              shapes=[list(m.shape) for m in meta])
        works: list[Any] = []
        keep: list[torch.Tensor] = []  # the posted sends read these asynchronously
        try:
            failure = self._post_sends(meta, checked(self.source, meta), works, keep)
            try:  # server_side.py's method: receive and load, one RPC
                results = self.client.collective_rpc(  # type: ignore[attr-defined]
                    "grpo_gloo_sync", {"update_info": asdict(info), "record": record},
                    self.timeout_s)
            except Exception:
                if failure is None:
                    raise
                results = None  # the worker reports "aborted": ours is the cause worth raising
            if failure is not None:
                raise failure
            for work in works:  # complete: the worker answered with every tensor received
                work.wait()
        except BaseException:
            # Close our sockets so the worker's pending receives fail now, not at the timeout.
            self.shutdown()
            raise
        server = results[0] if results and isinstance(results[0], dict) else {}
        self.last = {key.removesuffix("_ms"): ms for key, ms in server.items()}

    def _post_sends(self, meta: list[base.ParamMeta], tensors: Iterator[tuple[str, torch.Tensor]],
                    works: list[Any], keep: list[torch.Tensor]) -> Exception | None:
        """Post one broadcast per tensor, then the status word. A failure midway sends zeros for
        the rest and "aborted", so the waiting worker fails at once, whatever gloo does with a
        closed peer (returned)."""
        failure: Exception | None = None
        try:
            for _, tensor in tensors:
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
        keep.append(status)
        works.append(self.group.broadcast(status, 0))
        return failure

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            close_group(group)


def checked(pairs: Iterable[tuple[str, torch.Tensor]], meta: list[base.ParamMeta]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs``, each the tensor ``meta`` announced (name, dtype, shape), as many as announced:
    the worker sized its receive slots from ``meta``, so any other tensor is an error here."""
    sent = 0
    for name, tensor in pairs:
        got = (name, tensor.dtype, tuple(tensor.shape))
        want = ((meta[sent].name, meta[sent].dtype, tuple(meta[sent].shape))
                if sent < len(meta) else "no more tensors")
        if got != want:
            raise ValueError(f"tensor {sent} is {got}, but metadata() announced {want}")
        sent += 1
        yield name, tensor
    if sent != len(meta):
        raise ValueError(f"{sent} tensors sent, but metadata() announced {len(meta)}")


def trainer_engine(transport: str, client: base.VLLMWeightSyncClient, source: base.WeightSource,
                   timeout_s: float) -> base.TrainerWeightTransferEngine:
    """Join the server's ``transport`` engine as rank 0 of two, through vLLM's trainer factory."""
    if transport == "gloo":
        info: base.TrainerInitInfo = GlooTrainerInitInfo(timeout_s=timeout_s, rank=0)
    elif transport == "nccl":
        info = NCCLTrainerInitInfo(LOOPBACK, free_port(), 2, rank=0)
    else:
        info = IPCTrainerInitInfo(rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


# Once per process: a module's body runs once (a second registration raises ValueError).
WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
