"""Code that runs inside the vLLM worker (``--worker-extension-cls``): the ``/collective_rpc``
methods, and the gloo engine's worker side (registered on import: the registry is per process)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from grpo_nb.weight_sync import vllm_compat  # the version gate, before any vLLM name

# isort: split
from vllm.distributed.weight_transfer.base import layerwise_groups
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from grpo_nb.weight_sync import gloo_engine as gloo
from grpo_nb.weight_sync.config import Phases
from grpo_nb.weight_sync.verify import digest

ALIGN = 16  # bytes: every receive slot starts aligned, so it is viewed as its dtype, no copy


def receive_slots(info: gloo.GlooUpdateInfo, buffer: torch.Tensor | None
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One slot per tensor of ``info`` in ``buffer`` (a new one unless it has the size), each
    padded to ``ALIGN`` bytes: the buffer and the slots."""
    sizes = [torch.Size(shape).numel() * getattr(torch, dtype).itemsize
             for dtype, shape in zip(info.dtype_names, info.shapes, strict=True)]
    padded = [(n + ALIGN - 1) // ALIGN * ALIGN for n in sizes]
    if buffer is None or buffer.numel() != sum(padded):
        buffer = torch.empty(sum(padded), dtype=torch.uint8)
    return buffer, [slot[:n] for slot, n in zip(buffer.split(padded), sizes, strict=True)]


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """Worker-side engine: receives every tensor into a persistent buffer, loads per layer;
    its update starts and finishes as vLLM's NCCL engine's (layerwise reload)."""

    init_info_cls = gloo.GlooInitInfo
    update_info_cls = gloo.GlooUpdateInfo
    supports_draft_weight_update = False
    group: Any = None  # the trainer's gloo group, once it has joined
    buffer: torch.Tensor | None = None  # every update's receive slots: kept for the server's life

    def init_transfer_engine(self, init_info: gloo.GlooInitInfo) -> None:
        self.shutdown()  # a trainer that reconnects replaces its previous group
        rank = self.parallel_config.rank + init_info.rank_offset
        self.group = gloo.open_group(rank, init_info.world_size, init_info.timeout_s,
                                port=init_info.master_port, host=init_info.master_address)

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        vllm_compat.refresh_tied_heads(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which fails on a CPU-only
        # worker; every receive has been waited on when receive_weights returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: gloo.GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call "
                               "/init_weight_transfer_engine first")
        self.buffer, slots = receive_slots(update_info, self.buffer)
        # Post every receive now: gloo's threads fill the slots while this thread loads.
        works = [self.group.broadcast(slot, 0) for slot in slots]
        status = torch.zeros(1, dtype=torch.int32)
        status_work = self.group.broadcast(status, 0)
        timed, batch = Phases(wait_ms=0.0, load_ms=0.0), []
        names = update_info.names
        # vLLM's partition: one group per decoder layer, its tensors loaded together
        layer = {name: k for k, members in enumerate(layerwise_groups(names)) for name in members}
        for i, (name, dtype_name, shape, slot, work) in enumerate(zip(
                names, update_info.dtype_names, update_info.shapes, slots, works, strict=True)):
            with timed("wait_ms"):
                work.wait()
            batch.append((name, slot.view(getattr(torch, dtype_name)).view(shape)))
            if i + 1 == len(names) or layer[names[i + 1]] != layer[name]:
                with timed("load_ms"):
                    self.model.load_weights(batch)
                batch = []
        status_work.wait()
        if int(status.item()) != gloo.STATUS_OK:
            raise RuntimeError("the trainer aborted this weight transfer midway (its error is "
                               "raised there); the layers loaded so far hold partly new weights")
        self.last_timings = dict(timed)

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            gloo.close_group(group)


# Once per process: a module's body runs once (a second registration raises ValueError).
WeightTransferEngineFactory.register_engine(gloo.BACKEND, GlooWeightTransferEngine)


class _Recorder:
    """Wraps the model's ``load_weights``: while armed, records ``[name, digest]`` of each tensor
    it consumes; an unarmed update clears the record."""

    def __init__(self, model: Any) -> None:
        self.armed = False
        self.entries: list[list[str]] | None = None
        original = model.load_weights

        def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
            return original(self._watch(weights), *args, **kwargs)

        model.load_weights = load_weights

    def _watch(self, weights: Any) -> Any:
        for name, tensor in weights:
            if self.armed:
                self.entries.append([name, digest(tensor)])
            else:
                self.entries = None
            yield name, tensor

    def begin(self, record: bool) -> None:
        self.armed, self.entries = record, ([] if record else None)

    def read(self) -> list[list[str]] | None:
        self.armed = False
        return self.entries


def _recorder(worker: Any) -> _Recorder:
    """The worker's recorder, installed on first use (a method would become an RPC)."""
    recorder = getattr(worker, "grpo_weight_recorder", None)
    if recorder is None:
        recorder = worker.grpo_weight_recorder = _Recorder(worker.model_runner.get_model())
    return recorder


class GrpoWorkerExtension:
    """Mixed into vLLM's worker class; every method name must be new to that class."""

    def grpo_reload_weights(self, weights_path: str) -> None:
        """vLLM's ``reload_weights`` from a safetensors folder, then the tied heads rebuilt."""
        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        vllm_compat.refresh_tied_heads(worker.model_runner.get_model())

    def grpo_model_dtype(self) -> str:
        """The dtype the server holds its weights in (``"bfloat16"``, …)."""
        worker: Any = self
        return str(worker.model_config.dtype).removeprefix("torch.")

    def grpo_packed_modules(self) -> dict[str, list[str]]:
        """The served model's ``packed_modules_mapping``: each fused module and the checkpoint
        modules loaded into it (``qkv_proj``: ``q_proj``, ``k_proj``, ``v_proj``)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None)
                                        or {}).items()}

    def grpo_begin_update(self, record: bool) -> None:
        """The next update's tensors are digested (``record``) or not; the record restarts."""
        _recorder(self).begin(record)

    def grpo_update_record(self) -> list[list[str]] | None:
        """``[name, digest]`` of each tensor the last armed update loaded (``None``: none)."""
        return _recorder(self).read()

    def grpo_abort_update(self) -> None:
        """After a failed sync: close the update, finish half-loaded layers, leave the group."""
        worker: Any = self
        vllm_compat.finish_open_update(worker)
        if worker.weight_transfer_engine is not None:
            worker.weight_transfer_engine.shutdown()

    def grpo_gloo_sync(self, update_info: dict[str, Any],
                       record: bool = False) -> dict[str, float]:
        """vLLM's start → update → finish as one RPC (timings in ms); a failed receive still
        finishes the update, so no layer stays on the meta device."""
        worker: Any = self
        engine = worker.weight_transfer_engine  # gloo's: another refuses gloo's init info
        _recorder(self).begin(record)
        timed = Phases()
        with timed("start_ms"):
            worker.start_weight_update()
        try:
            with timed("update_ms"):
                worker.update_weights(update_info)
        except BaseException:
            with contextlib.suppress(Exception), vllm_compat.in_vllm_config(worker):
                engine.finish_weight_update()
            raise
        with timed("finish_ms"):
            worker.finish_weight_update()
        return {**timed, **engine.last_timings}
