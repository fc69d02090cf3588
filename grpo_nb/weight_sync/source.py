"""The trainer's weights as vLLM's trainer engines read them: a ``WeightSource`` in the send
dtype (see :func:`grpo_nb.weight_sync.verify.sent_tensors`).

vLLM's own ``ModuleSource`` sends each parameter in its own dtype. A trainer that keeps
float32 master weights for a bf16 server would send twice the bytes and leave the cast to the
server's loader; here the cast happens on the trainer, where the digest that verifies the sync
is computed on the very tensor that travels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta

from grpo_nb.weight_sync.verify import sent_tensors


class SendSource(ModuleSource):
    """``ModuleSource`` whose tensors (and metadata) are in ``dtype()``, asked at each use:
    the syncer learns the server's dtype only when it first talks to it."""

    def __init__(self, module: torch.nn.Module, dtype: Callable[[], torch.dtype]) -> None:
        super().__init__(module)
        self.dtype = dtype

    def metadata(self) -> list[ParamMeta]:
        dtype = self.dtype()
        return [ParamMeta(name, dtype, tuple(p.shape))
                for name, p in self._module.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return sent_tensors(self._module, self.dtype())
