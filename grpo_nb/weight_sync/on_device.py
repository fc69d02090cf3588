"""Run a trainer-side weight-transfer engine under the trainer's CUDA device, from any thread.

vLLM's CUDA engines use the *current* device: NCCL builds the trainer's communicator on
``torch.accelerator.current_device_index()``, IPC names that GPU in its handles, and both send
on ``torch.cuda.current_stream()``. The current device is per thread, and 0 in a thread that
never chose one — and the ring syncs from worker threads (``asyncio.to_thread`` may pick a
different one each time). With the trainer on ``cuda:1`` and the server on ``cuda:0`` an
unscoped engine would land both NCCL ranks on GPU 0. So the engine is built inside
:func:`device_scope` and wrapped in :class:`OnDevice`, which scopes every later call too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def device_scope(device: torch.device) -> Iterator[None]:
    """``torch.cuda.device(device)`` for a CUDA device; nothing otherwise."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


class OnDevice:
    """A trainer engine whose calls (``send_weights``, ``shutdown``) run under ``device``;
    other attributes are the engine's own."""

    def __init__(self, engine: Any, device: torch.device) -> None:
        self.engine, self.device = engine, device

    def send_weights(self) -> None:
        with device_scope(self.device):
            self.engine.send_weights()

    def shutdown(self) -> None:
        with device_scope(self.device):
            self.engine.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
