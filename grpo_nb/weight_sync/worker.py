"""Code that runs *inside* the vLLM worker, loaded with ``--worker-extension-cls``.

vLLM imports the class named by ``--worker-extension-cls`` in its worker process and mixes it
into the worker class, so its methods become callable through ``POST /collective_rpc``::

    server start ─► worker imports grpo_nb.weight_sync.worker
                        ├─ registers the gloo engine (gloo_engine.register())
                        │     so --weight-transfer-config '{"backend": "gloo"}' resolves
                        └─ GrpoWorkerExtension mixed into the worker class
    trainer ──POST /collective_rpc {"method": "grpo_transfer_backends"}──► ["gloo", "nccl", …]
    trainer ──POST /collective_rpc {"method": "grpo_gloo_sync", …}──► start + receive + finish
    trainer ──POST /collective_rpc {"method": "grpo_begin_update", "record": true}──► arm
            … any transport: the model's load_weights digests every tensor it receives …
    trainer ──POST /collective_rpc {"method": "grpo_update_record"}──► [[name, digest], …]
    trainer ──POST /collective_rpc {"method": "grpo_abort_update"}──► close a half-done update

The import has to happen in the worker process: vLLM's engine registry is per process, and
the worker creates its engine right after loading the model. ``/collective_rpc`` runs in the
engine core between two engine steps: it never queues behind generation.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from grpo_nb.weight_sync.gloo_engine import (
    GlooWeightTransferEngine,
    refresh_tied_heads,
    register,
)
from grpo_nb.weight_sync.verify import digest

register()


class _Recorder:
    """Wraps the model's ``load_weights`` (every transport's last step) once; while armed,
    records ``[name, digest]`` of each tensor it receives, before the model consumes it (a
    packed NCCL buffer is reused right after). An update that arrives unarmed clears the
    record, so a later read never reports an older update as the last one."""

    def __init__(self, model: Any) -> None:
        self.armed = False
        self.entries: list[list[str]] | None = None
        original = model.load_weights

        def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
            return original(self._watch(weights), *args, **kwargs)

        model.load_weights = load_weights

    def _watch(self, weights: Any) -> Any:
        for name, tensor in weights:
            if self.armed and self.entries is not None:
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
    """The worker's recorder, installed on first use (a plain function: every method of the
    extension class becomes callable over ``/collective_rpc``)."""
    recorder = getattr(worker, "_grpo_weight_recorder", None)
    if recorder is None:
        recorder = worker._grpo_weight_recorder = _Recorder(worker.model_runner.get_model())
    return recorder


class GrpoWorkerExtension:
    """Mixed into vLLM's worker class; every method name must be new to that class."""

    def grpo_transfer_backends(self) -> list[str]:
        """The weight-transfer engines this worker can create (proves the extension loaded)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        return sorted(WeightTransferEngineFactory._registry)

    def grpo_meta_tensors(self) -> list[str]:
        """Names of model tensors left on the meta device (a forward pass would fail)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return [name for name, t in tensors if t.is_meta]

    def grpo_reload_weights(self, weights_path: str) -> None:
        """vLLM's ``reload_weights`` from a safetensors folder, then the tied output heads
        rebuilt: the reload is layerwise too, and leaves a tied head computing logits from
        the weights the server started with (:func:`refresh_tied_heads`)."""
        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        refresh_tied_heads(worker.model_runner.get_model())

    def grpo_model_dtype(self) -> str:
        """The dtype the server holds its weights in (``"bfloat16"``, …)."""
        worker: Any = self
        return str(worker.model_config.dtype).removeprefix("torch.")

    def grpo_begin_update(self, record: bool) -> None:
        """The next update's tensors are digested (``record``) or not; the record restarts."""
        _recorder(self).begin(record)

    def grpo_update_record(self) -> list[list[str]] | None:
        """``[name, digest]`` of every tensor the last armed update delivered to
        ``load_weights``, in arrival order (``None``: not recorded); disarms."""
        return _recorder(self).read()

    def grpo_abort_update(self) -> dict[str, bool]:
        """Return the worker to a clean state after a failed or stalled sync: close a weight
        update left open (vLLM refuses every later ``start_weight_update`` while one is),
        put back any layer a failed reload left mid-load (old or partly new weights, never
        the meta device), and leave the transfer group (the next sync opens a fresh one)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            finalize_layerwise_reload,
        )

        worker: Any = self
        done = {"finished": False, "reloaded": False}
        if getattr(worker, "_weight_update_active", False):
            worker.finish_weight_update()
            done["finished"] = True
        model = worker.model_runner.get_model()
        if any(LAYERWISE_INFO[m].can_load() for m in model.modules() if m in LAYERWISE_INFO):
            with set_current_vllm_config(worker.vllm_config):
                finalize_layerwise_reload(model, worker.model_config)
            done["reloaded"] = True
        if worker.weight_transfer_engine is not None:
            worker.weight_transfer_engine.shutdown()
        return done

    def grpo_gloo_sync(self, update_info: dict[str, Any],
                       record: bool = False) -> dict[str, float]:
        """vLLM's start → update → finish as one RPC (one HTTP round trip instead of three);
        ``record``: digest every tensor received (:meth:`grpo_begin_update`).

        Returns the worker's timings in ms. If receiving fails, every layer is put back on
        real tensors (old weights, or partly new ones) before the error propagates, so a
        forward pass can never meet a layer left on the meta device; the trainer marks the
        server dirty and keeps it paused until a full re-send succeeds.
        """
        worker: Any = self
        engine = worker.weight_transfer_engine
        if not isinstance(engine, GlooWeightTransferEngine) or engine.group is None:
            raise RuntimeError("grpo_gloo_sync needs the gloo weight-transfer engine, "
                               "initialised (call /init_weight_transfer_engine first)")
        _recorder(self).begin(record)
        t0 = time.perf_counter()
        worker.start_weight_update()
        t1 = time.perf_counter()
        try:
            worker.update_weights(update_info)
        except BaseException:
            from vllm.config import set_current_vllm_config

            with contextlib.suppress(Exception), set_current_vllm_config(worker.vllm_config):
                engine.finish_weight_update()
            raise
        t2 = time.perf_counter()
        worker.finish_weight_update()
        t3 = time.perf_counter()
        return {"start_ms": (t1 - t0) * 1e3, "update_ms": (t2 - t1) * 1e3,
                "finish_ms": (t3 - t2) * 1e3, **engine.last_timings}
