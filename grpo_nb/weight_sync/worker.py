"""Code that runs *inside* the vLLM worker, loaded with ``--worker-extension-cls``.

vLLM imports the class named by ``--worker-extension-cls`` in its worker process and mixes it
into the worker class, so its methods become callable through ``POST /collective_rpc``::

    server start ─► worker imports grpo_nb.weight_sync.worker
                        ├─ registers the gloo engine (gloo_engine.register())
                        │     so --weight-transfer-config '{"backend": "gloo"}' resolves
                        └─ GrpoWorkerExtension mixed into the worker class
    trainer ──POST /collective_rpc {"method": "grpo_transfer_backends"}──► ["gloo", "nccl", …]

The import has to happen in the worker process: vLLM's engine registry is per process, and
the worker creates its engine right after loading the model.
"""

from __future__ import annotations

from grpo_nb.weight_sync.gloo_engine import register

register()


class GrpoWorkerExtension:
    """Mixed into vLLM's worker class; every method name must be new to that class."""

    def grpo_transfer_backends(self) -> list[str]:
        """The weight-transfer engines this worker can create (proves the extension loaded)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        return sorted(WeightTransferEngineFactory._registry)
