"""Code that runs *inside* the vLLM worker, loaded with ``--worker-extension-cls``.

vLLM imports the class named by ``--worker-extension-cls`` in its worker process and mixes it
into the worker class, so its methods become callable through ``POST /collective_rpc``::

    server start ─► worker imports grpo_nb.weight_sync.worker
                        ├─ registers the gloo engine (gloo_engine.register())
                        │     so --weight-transfer-config '{"backend": "gloo"}' resolves
                        └─ GrpoWorkerExtension mixed into the worker class
    trainer ──POST /collective_rpc {"method": "grpo_transfer_backends"}──► ["gloo", "nccl", …]
    trainer ──POST /collective_rpc {"method": "grpo_gloo_sync", …}──► start + receive + finish

The import has to happen in the worker process: vLLM's engine registry is per process, and
the worker creates its engine right after loading the model.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from grpo_nb.weight_sync.gloo_engine import GlooWeightTransferEngine, register

register()


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

    def grpo_gloo_sync(self, update_info: dict[str, Any]) -> dict[str, float]:
        """vLLM's start → update → finish as one RPC (one HTTP round trip instead of three).

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
