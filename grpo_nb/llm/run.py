"""Asynchronous (or synchronous) GRPO on the tiny Qwen3 model, served by vLLM with weight sync.

The controller of the LLM ring (:mod:`grpo_nb.llm.actors`), on :class:`grpo_nb.ring.Controller`::

    train(cfg) ──► tiny model folder (tiny_model.build_or_load) ──► VLLMServer (+ gloo engine)
        │                                                                  │
        ├─► run_ring(): spawn the stages, relay their events into MetricsRecorder rows;
        │       watchers: the server process exits → RunAborted at once; Stop → trainer drains
        ▼
    runs/<name>/  metrics.jsonl, config.json, checkpoint/, result.json ──► RunResult

The server is started (and always stopped) here unless the caller passes one, which is how
notebook 05 runs the async and the sync mode against the same server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from grpo_nb.config import runs_dir, smoke_mode
from grpo_nb.llm.actors import Generator, Reference, Scorer, Trainer
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import RingSpec, load_prompts
from grpo_nb.llm.summary import RunResult, summarize
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.ring import Controller, Event, RingError

__all__ = ["RunAborted", "RunResult", "ServerWatch", "run_ring", "start_server", "train"]


class RunAborted(RingError):
    """The ring could not go on (server died, an actor failed); the message says why."""


class ServerWatch:
    """``exited`` resolves the moment the server's process ends, without polling: a pidfd
    becomes readable then (Linux); elsewhere a daemon thread waits on the process.

    A server this process did not start (``proc is None``) cannot be watched; its failed
    requests still end the run.
    """

    def __init__(self, server: Any) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[None] = self.loop.create_future()
        self.fd: int | None = None
        proc = getattr(server, "proc", None)
        if proc is None:
            return
        if not hasattr(os, "pidfd_open"):
            threading.Thread(target=self._wait_in_thread, args=(proc,), daemon=True).start()
            return
        try:
            self.fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:  # already gone (and reaped)
            self._exited()
            return
        self.loop.add_reader(self.fd, self._exited)

    def _wait_in_thread(self, proc: Any) -> None:
        proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed first: nobody is listening
            self.loop.call_soon_threadsafe(self._exited)

    def _exited(self) -> None:
        self.close()
        if not self.exited.done():
            self.exited.set_result(None)

    def close(self) -> None:
        if self.fd is not None:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = None

    def describe(self) -> str:
        proc = getattr(self.server, "proc", None)
        code = proc.poll() if proc is not None else "?"
        return f"the vLLM server at {self.server.url} exited (code {code})"

    async def died(self, step: Callable[[], int]) -> None:
        """A watcher for :meth:`Controller.relay`: raises :class:`RunAborted` when it exits."""
        await asyncio.shield(self.exited)
        raise RunAborted(f"{self.describe()}: run aborted at step {step()}")

    async def gone_within(self, grace_s: float = 3.0) -> str | None:
        """Why the server is gone, waiting up to ``grace_s`` for a dying one to exit (else None).

        A killed server first shows up as a failed request in some actor, a moment before its
        process has exited; waiting lets the error name the real cause.
        """
        if getattr(self.server, "proc", None) is None:
            return None if await asyncio.to_thread(self.server.is_running) else self.describe()
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), grace_s)
        except TimeoutError:
            return None
        return self.describe()


async def _forward_stop(stop: asyncio.Event, trainer: Any) -> None:
    await stop.wait()
    await trainer.request_stop.call_one()


async def run_ring(cfg: LLMConfig, spec: RingSpec, rec: MetricsRecorder, *, server: Any = None,
                   on_event: Callable[[str, MetricsRecorder], None] | None = None,
                   stop: asyncio.Event | None = None, backend: str = "asyncio",
                   stop_timeout_s: float = 15.0) -> dict[str, Any]:
    """Spawn the ring, relay its events into ``rec`` until the trainer exits; stop all actors.

    ``on_event(kind, rec)`` runs on the controller after each relayed event (live plots,
    progress bars). When ``stop`` is set, the trainer finishes its step, drains, syncs,
    evaluates and checkpoints. Returns the trainer's exit data; raises :class:`RunAborted`.
    """
    import torch

    if stop is not None and not isinstance(stop, asyncio.Event):
        raise TypeError(f"stop must be an asyncio.Event, got {type(stop).__name__}")
    # Process-wide settings belong to the process that owns them: the trainer runs in this one.
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.trainer_threads)
    watch = ServerWatch(server) if server is not None else None
    try:
        async with Controller(backend, rec, stop_timeout_s=stop_timeout_s) as ring:
            here = ring.procs(here=True)
            trainer = ring.spawn(here, "trainer", Trainer, cfg, spec, ring.metrics)
            scorer = ring.spawn(here, "scorer", Scorer, cfg, ring.metrics)
            reference = ring.spawn(here, "reference", Reference, cfg, spec, ring.metrics)
            gens = ring.spawn(ring.procs(cfg.generators), "generators", Generator, cfg, spec,
                              await scorer.inlet.call_one(), ring.metrics)
            await trainer.start.call_one(gens)
            await reference.start.call_one(await trainer.inlet.call_one())
            await scorer.start.call_one(await reference.inlet.call_one())
            await gens.start.call()

            async def explain(event: Event) -> BaseException:
                gone = await watch.gone_within() if watch is not None else None
                return RunAborted(f"{gone + ': ' if gone else ''}ring actor "
                                  f"{event.data['actor']} failed: {event.data['error']}\n"
                                  f"{event.data['traceback']}")

            watchers = [*([watch.died(lambda: len(rec.rows("step")))] if watch else []),
                        *([_forward_stop(stop, trainer)] if stop is not None else [])]
            exited = await ring.relay(
                {"trainer"}, watchers=watchers, explain=explain,
                on_event=None if on_event is None else lambda ev: on_event(ev.kind, rec))
    finally:
        if watch is not None:
            watch.close()
    return exited["trainer"]


async def train(cfg: LLMConfig, *, model_dir: str | Path | None = None, name: str | None = None,
                resume: str | Path | None = None, server: Any = None,
                on_event: Callable[[str, MetricsRecorder], None] | None = None,
                stop: asyncio.Event | None = None, backend: str = "asyncio",
                smoke: bool | None = None, progress: bool = True) -> RunResult:
    """Run GRPO on the LLM end to end; writes ``runs/<name>/``. See module docstring."""
    from transformers import AutoTokenizer

    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    smoke = smoke_mode() if smoke is None else smoke
    if model_dir is None:
        model_dir = await asyncio.to_thread(build_or_load, TinyModelConfig(), progress=progress)
    model_dir = str(model_dir)
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / "checkpoint" / "trainer_state.json").is_file():
            raise FileNotFoundError(f"--resume {resume}: no checkpoint/ in that run folder")
    else:
        run_dir = runs_dir() / (name or f"llm-{cfg.mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    rec = MetricsRecorder(run_dir, append=resume is not None)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=str))
    prompts, eval_set = load_prompts(AutoTokenizer.from_pretrained(model_dir), smoke)
    if cfg.eval_size < len(eval_set[0]):
        eval_set = (eval_set[0][:cfg.eval_size], eval_set[1][:cfg.eval_size])
    own = server is None
    if own:
        server = await asyncio.to_thread(start_server, model_dir, cfg, progress)
    try:
        spec = RingSpec(server.url, server.model_name, model_dir, prompts, eval_set,
                        str(run_dir), str(run_dir / "checkpoint") if resume else None)
        t0 = time.perf_counter()
        out = await run_ring(cfg, spec, rec, server=server, on_event=on_event, stop=stop,
                             backend=backend)
        wall = time.perf_counter() - t0
    finally:
        if own:
            await asyncio.to_thread(server.stop)
        rec.close()
    result = summarize(rec, cfg, wall, out.get("dropped", 0))
    (run_dir / "result.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def start_server(model_dir: str, cfg: LLMConfig, progress: bool = True) -> Any:
    """A vLLM server for ``model_dir`` with this config's weight-sync settings (loopback)."""
    from grpo_nb.serving.server import ServerConfig, VLLMServer

    scfg = ServerConfig.smoke(model_dir)
    for key, value in cfg.sync.server_settings().items():
        setattr(scfg, key, value)
    return VLLMServer(scfg).start(progress=progress)
