"""Rewards off the event loop, each completion's bounded in time: :class:`BoundedReward` (the LLM
ring's Scorer shares its loop with other actors, which one slow answer must not stall).

Two routes, because each one alone loses something. A reward given by names (every term of its
spec a string: ``"math"``, ``"exact+0.1*format"``, ``"module:function"``) runs in a child Python
process started with ``python -c`` (so no ``__main__`` is imported again), on its main thread,
where math-verify's own timeouts work (SIGALRM: :func:`~grpo_nb.tasks.rewards.math_answer`);
past ``timeout_s`` the process is killed (a process can be stopped, a thread cannot) and the
next call starts another. A callable (a notebook cell's function does not import in another
process) runs in a daemon thread of its own under the same bound, math-verify there without its
timeout; a thread past the bound is left running. Either way a completion past the bound scores
``None``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from grpo_nb.tasks.rewards import WeightedReward, make_reward

START_TIMEOUT_S = 120.0  # the child's Python start-up and the reward's imports
LINE_LIMIT = 1 << 26  # bytes of one JSON line: a batch of long completions


class RewardError(RuntimeError):
    """The reward raised in its process (the traceback is in the message), or the process died."""


def _line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


class BoundedReward:
    """``await score([(completion_text, answer), ...])``: each pair's reward, ``None`` for one
    not scored within ``timeout_s`` (see the module docstring); :meth:`close` ends the child."""

    def __init__(self, reward: WeightedReward, timeout_s: float) -> None:
        self.reward, self.timeout_s = reward, timeout_s
        self.in_process = all(isinstance(term, str) for term, _ in reward.terms)
        self.proc: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()  # one batch at a time in the child

    async def score(self, pairs: Sequence[tuple[str, str]]) -> list[float | None]:
        if not self.in_process:
            return [await self._in_thread(text, answer) for text, answer in pairs]
        out: list[float | None] = []
        async with self.lock:
            while len(out) < len(pairs):  # after a timeout: the rest, in a new process
                out += await self._batch(pairs[len(out):])
        return out

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def _batch(self, pairs: Sequence[tuple[str, str]]) -> list[float | None]:
        """The pairs' rewards up to the first one past the bound (``None``: the child killed)."""
        proc = await self._started()
        assert proc.stdin is not None
        proc.stdin.write(_line({"pairs": [list(p) for p in pairs]}))
        await proc.stdin.drain()
        out: list[float | None] = []
        for _ in pairs:
            try:
                reply = await self._reply(proc, self.timeout_s)
            except TimeoutError:
                await self.close()
                return [*out, None]
            out.append(float(reply["value"]))
        return out

    async def _started(self) -> asyncio.subprocess.Process:
        if self.proc is not None and self.proc.returncode is None:
            return self.proc
        # the parent's import path: a "module:function" term imports in the child as here
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self.proc = proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from grpo_nb.tasks.scoring import serve; serve()",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path}, limit=LINE_LIMIT)
        assert proc.stdin is not None
        proc.stdin.write(_line({"terms": [list(t) for t in self.reward.terms],
                                "default": self.reward.default}))
        await proc.stdin.drain()
        try:
            await self._reply(proc, START_TIMEOUT_S)
        except TimeoutError:
            await self.close()
            raise RewardError(f"the reward process did not start within {START_TIMEOUT_S:g} s"
                              ) from None
        except BaseException:
            await self.close()
            raise
        return proc

    async def _reply(self, proc: asyncio.subprocess.Process, timeout_s: float) -> dict[str, Any]:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        if not line:
            self.proc = None
            raise RewardError(f"the reward process exited (code {await proc.wait()}); its "
                              "output went to this process's stderr")
        reply = json.loads(line)
        if "error" in reply:
            raise RewardError(f"reward {self.reward.terms!r} raised in its process:\n"
                              f"{reply['error']}")
        return reply

    async def _in_thread(self, text: str, answer: str) -> float | None:
        done = on_thread(lambda: self.reward(text, answer), "grpo-reward")
        try:  # wrap_future drops the result of a thread that ends after the loop closed
            return float(await asyncio.wait_for(asyncio.wrap_future(done), self.timeout_s))
        except TimeoutError:
            return None


def on_thread(fn: Callable[[], Any], name: str) -> concurrent.futures.Future:
    """``fn()`` on a daemon thread of its own; its Future is running from the start, so a
    waiter's timeout or cancel cannot cancel it under the thread (the thread runs on)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_running_or_notify_cancel()

    def run() -> None:
        try:
            done.set_result(fn())
        except Exception as err:  # handed to the waiter
            done.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def serve() -> None:
    """The child: the reward's spec, then batches of pairs, on stdin; ``{"ready"}``, then one
    ``{"value"}`` a pair (or ``{"error"}``, which ends the batch) on stdout, a JSON object a
    line. What the reward prints goes to stderr; Ctrl-C is the parent's to handle (the child
    ends when its stdin closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: Any) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    first = sys.stdin.readline()
    if not first:
        return
    spec = json.loads(first)
    try:
        reward = make_reward([(term, weight) for term, weight in spec["terms"]],
                             default=spec["default"])
    except Exception:
        send({"error": traceback.format_exc()})
        return
    send({"ready": True})
    for line in sys.stdin:
        for text, answer in json.loads(line)["pairs"]:
            try:
                value = float(reward(text, answer))
            except Exception:
                send({"error": traceback.format_exc()})
                break
            send({"value": value})
