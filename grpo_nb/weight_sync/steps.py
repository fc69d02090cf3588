"""Two small tools a sync is built from: per-phase timing, and a call with a deadline."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class Phases(dict):
    """``with phases("pause"): …`` records the block's milliseconds under that name."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + (time.perf_counter() - t) * 1e3


def within(seconds: float, fn: Callable[[], Any], name: str) -> Any:
    """``fn()`` on a daemon thread of its own; its result, or :class:`TimeoutError` after
    ``seconds`` (the thread is left behind: a stalled send or a blocked device call cannot be
    interrupted from outside, only abandoned; a daemon thread never delays the exit)."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as err:  # handed to the waiting thread
            done.set_exception(err)

    threading.Thread(target=run, daemon=True, name=name).start()
    try:
        return done.result(timeout=seconds)
    except FutureTimeout:
        raise TimeoutError(f"{name} did not finish within {seconds:.0f} s") from None


def in_background(fn: Callable[[], Any], name: str) -> None:
    """``fn()`` on a daemon thread, errors ignored (a shutdown that may never return)."""

    def run() -> None:
        with contextlib.suppress(Exception):
            fn()

    threading.Thread(target=run, daemon=True, name=name).start()
