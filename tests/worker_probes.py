"""The worker extension the tests' vLLM server loads (``--worker-extension-cls
worker_probes.ProbeWorkerExtension``, this folder on the server's ``PYTHONPATH``): the
package's own extension, plus RPCs that only tests ask."""

from __future__ import annotations

from grpo_nb.weight_sync.server_side import GrpoWorkerExtension

EXTENSION = f"{__name__}.ProbeWorkerExtension"


class ProbeWorkerExtension(GrpoWorkerExtension):
    """Mixed into vLLM's worker class, as :class:`GrpoWorkerExtension` is."""

    def grpo_meta_tensors(self) -> list[str]:
        """Names of model tensors left on the meta device (a forward pass would fail)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return [name for name, t in tensors if t.is_meta]
