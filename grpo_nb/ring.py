"""What the toy ring (:mod:`grpo_nb.toy_actors`) and the LLM ring (:mod:`grpo_nb.llm_ring`)
share: the plumbing of an actor whose work is a background loop.

Both rings are written once against an actor API module (``grpo_nb.actors`` or
``monarch.actor``), and every stage in them follows the same pattern::

    start (endpoint) ──► _launch(loop) ──► task: _guard(loop)
                                              │ crash: Event("error", actor, error, traceback)
                                              ▼            ──► controller (metrics port)
    __cleanup__ (actor stopped) ──► cancel_task(task)

- :class:`Event` is the one message type on the metrics port (a module-level dataclass, so it
  pickles between Monarch processes);
- :func:`cancel_task` cancels a loop and waits until it has really finished;
- :class:`Busy` batches an actor's busy intervals (the timeline plots) into few messages;
- :func:`stage_base` builds the ``_Stage`` base class for one actor API module.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections.abc import Coroutine
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any


@dataclass
class Event:
    """What actors tell the controller through the metrics port.

    ``kind`` is e.g. ``"step"``, ``"busy"``, ``"exited"`` or ``"error"`` (the LLM ring also
    sends ``"sync"``, ``"eval"`` and ``"dropped"``). An ``"error"`` event's ``data`` is
    ``{"actor": name, "error": repr(exception), "traceback": formatted traceback}``.
    """

    kind: str
    data: Any


async def cancel_task(task: asyncio.Task | None, *, quiet: bool = False) -> None:
    """Cancel ``task`` (if still running) and wait until it has finished.

    ``quiet=True`` also swallows an ``Exception`` the task raises while it unwinds.
    """
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, *((Exception,) if quiet else ())):
            await task


class Busy:
    """Collects an actor's busy intervals (wall-clock seconds) and ships them in batches."""

    def __init__(self, actor: str, metrics: Any, flush_every_s: float = 0.2) -> None:
        self.actor, self.metrics, self.flush_every_s = actor, metrics, flush_every_s
        self.rows: list[tuple[str, str, float, float]] = []
        self.last_flush = time.time()

    def add(self, label: str, start: float) -> None:
        end = time.time()
        self.rows.append((self.actor, label, start, end))
        if end - self.last_flush > self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.metrics.send(Event("busy", self.rows))
            self.rows = []
        self.last_flush = time.time()


@cache
def stage_base(api: ModuleType) -> type:
    """The ``_Stage`` base class (an ``api.Actor``) that every stage of both rings extends."""

    class _Stage(api.Actor):
        """Shared plumbing: a background loop that reports crashes instead of dying silently.

        Subclasses set ``self.metrics`` (the controller's port) and ``name``.
        """

        name = "stage"
        metrics: Any
        quiet_cancel = False  # passed to cancel_task by __cleanup__

        def _launch(self, coro: Coroutine[Any, Any, None]) -> None:
            self._task = asyncio.create_task(self._guard(coro))

        async def _guard(self, coro: Coroutine[Any, Any, None]) -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.metrics.send(Event("error", {"actor": self.name, "error": repr(err),
                                                  "traceback": traceback.format_exc()}))
            finally:
                self._loop_ended()

        def _loop_ended(self) -> None:
            """Hook: runs after the loop has ended, however it ended (and after any error event)."""

        async def __cleanup__(self, exc: Any) -> None:
            await cancel_task(getattr(self, "_task", None), quiet=self.quiet_cancel)

    return _Stage
