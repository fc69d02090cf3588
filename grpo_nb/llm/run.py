"""The LLM ring's controller: ``train(cfg)`` loads model and data, starts a vLLM server (unless
one is passed in), runs the ring (:func:`run_ring`) into ``runs/<name>/``, returns a RunResult."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from grpo_nb import partition
from grpo_nb.config import runs_dir, smoke_mode, unique_run_name
from grpo_nb.llm import placement
from grpo_nb.llm.actors import Generator, Reference, Scorer, Trainer
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import RingSpec, load_data
from grpo_nb.llm.policy import resolve_checkpoint
from grpo_nb.llm.summary import RunResult, summarize
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.ring import Controller, Event, RingError
from grpo_nb.ring_core import Admit
from grpo_nb.serving.processes import wait_exit
from grpo_nb.serving.server import VLLMServer
from grpo_nb.tiny_model import build_or_load


class RunAborted(RingError):
    """The ring could not go on (server died, an actor failed); the message says why."""


class ServerWatch:
    """``exited`` resolves when the server's process ends (only one this process started)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        proc = getattr(server, "proc", None)
        self.exited: asyncio.Future[Any] = (
            asyncio.ensure_future(wait_exit(proc.pid)) if proc is not None
            else asyncio.get_running_loop().create_future())

    def close(self) -> None:
        self.exited.cancel()

    def describe(self) -> str:
        proc = getattr(self.server, "proc", None)
        code = proc.poll() if proc is not None else "?"
        return f"the vLLM server at {self.server.url} exited (code {code})"

    async def died(self, step: Callable[[], int]) -> None:
        """A watcher for :meth:`Controller.relay`: raises :class:`RunAborted` when it exits."""
        await asyncio.shield(self.exited)
        raise RunAborted(f"{self.describe()}: run aborted at step {step()}")

    async def gone_within(self, grace_s: float = 3.0) -> str | None:
        """Why the server is gone, waiting ``grace_s`` for a dying one (else None): a failed
        request shows a moment before the exit, which names the real cause."""
        if getattr(self.server, "proc", None) is None:
            return None if await asyncio.to_thread(self.server.is_running) else self.describe()
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), grace_s)
        except TimeoutError:
            return None
        return self.describe()


@contextlib.contextmanager
def trainer_cores(cfg: LLMConfig, server: Any, backend: str) -> Iterator[partition.Plan]:
    """Within it, a CPU trainer in this process runs on the cores a pinned server leaves free;
    the plan states the torch threads the trainer sets (``cfg.trainer_threads``)."""
    if backend != "asyncio":
        p = partition.Plan(why="the trainer runs in a process of its own")
    elif placement.trainer_device(cfg) != "cpu":
        p = partition.Plan(why="the trainer runs on a GPU")
    else:
        p = partition.beside(getattr(server, "cpus", None))
    p = replace(p, trainer_threads=cfg.trainer_threads)
    with partition.pinned(p):
        yield p


async def _forward_stop(stop: asyncio.Event, trainer: Any) -> None:
    await stop.wait()
    await trainer.request_stop.call_one()


STAGES = {"generators": Generator, "scorer": Scorer, "reference": Reference, "trainer": Trainer}


async def run_ring(cfg: LLMConfig, spec: RingSpec, rec: MetricsRecorder, *, server: Any = None,
                   on_event: Callable[[str, MetricsRecorder], None] | None = None,
                   stop: asyncio.Event | None = None, backend: str = "asyncio",
                   admit: Admit | None = None) -> dict[str, Any]:
    """Spawn and wire the ring's four stages (the trainer with ``admit``, None:
    :func:`grpo_nb.ring_core.admit`), relay its events into ``rec`` (then ``on_event(kind,
    rec)``) until the trainer exits; ``stop`` ends it after the current step. On Monarch the
    trainer gets a process of its own (its torch threads, its GPU), else every stage but the
    generators runs in this one. Returns the trainer's exit data."""
    if stop is not None and not isinstance(stop, asyncio.Event):
        raise TypeError(f"stop must be an asyncio.Event, got {type(stop).__name__}")
    watch = ServerWatch(server) if server is not None else None

    async def explain(event: Event) -> BaseException:
        gone = await watch.gone_within() if watch is not None else None
        return RunAborted(f"{gone + ': ' if gone else ''}ring actor {event.data['actor']} "
                          f"failed: {event.data['error']}\n{event.data['traceback']}")

    try:
        with trainer_cores(cfg, server, backend) as plan:
            rec.log("partition", plan=plan.describe(), active=plan.active)
            async with Controller(backend, rec) as ring:
                own = {"trainer": ring.procs(1)} if backend == "monarch" else {}
                trainer = (await ring.start_ring(STAGES, (cfg, spec), generators=cfg.generators,
                                                 procs=own, admit=admit)).trainer
                watchers = [*([watch.died(lambda: len(rec.rows("step")))] if watch else []),
                            *([_forward_stop(stop, trainer)] if stop is not None else [])]
                exited = await ring.relay(
                    {"trainer"}, watchers=watchers, explain=explain,
                    on_event=None if on_event is None else lambda ev: on_event(ev.kind, rec))
            return exited["trainer"]
    finally:
        if watch is not None:
            watch.close()


async def train(cfg: LLMConfig, *, model_dir: str | Path | None = None, name: str | None = None,
                resume: str | Path | None = None, server: Any = None,
                on_event: Callable[[str, MetricsRecorder], None] | None = None,
                stop: asyncio.Event | None = None, backend: str = "asyncio",
                smoke: bool | None = None, progress: bool = True,
                admit: Admit | None = None) -> RunResult:
    """Run GRPO on ``model_dir`` (else ``cfg.model``, else the tiny model) into ``runs/<name>/``;
    without a ``server`` (which must serve it) one is started and always stopped. ``admit``:
    the trainer's admission rule (None: :func:`grpo_nb.ring_core.admit`)."""
    smoke = smoke_mode() if smoke is None else smoke
    model = str(model_dir or cfg.model  # neither: the tiny model, built once and cached
                or await asyncio.to_thread(build_or_load, progress=progress))
    cfg = (cfg.replace(model=model) if cfg.model != model else cfg).resolve()
    if resume is not None:
        run_dir = Path(resume)
        resolve_checkpoint(run_dir / "checkpoint")  # none: fail before a server starts
    else:
        run_dir = runs_dir() / (name or unique_run_name(f"llm-{cfg.mode}"))
    from transformers import AutoTokenizer

    # The data before the run folder: bad input (InputError) leaves neither a folder nor a server.
    data = await asyncio.to_thread(load_data, AutoTokenizer.from_pretrained(model), cfg, smoke)
    rec = MetricsRecorder(run_dir, append=resume is not None)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=str))
    rec.log("data", train=len(data.train), test=len(data.test), filtered=data.filtered,
            task=data.kind, prompt_example=data.prompt_example,
            chat_template_kwargs=data.template_kwargs)
    own = server is None
    server = server_for(model, cfg) if own else server
    try:
        if own:
            await server.start_async(progress=progress)
        spec = RingSpec(server.url, server.model_name, model, data.train, data.test,
                        str(run_dir), str(run_dir / "checkpoint") if resume else None,
                        reward_default=data.reward_default, api_key=server.api_key)
        t0 = time.perf_counter()
        out = await run_ring(cfg, spec, rec, server=server, on_event=on_event, stop=stop,
                             backend=backend, admit=admit)
        wall = time.perf_counter() - t0
    finally:
        if own:
            await asyncio.to_thread(server.stop)
        rec.close()
    result = summarize(rec, cfg, wall, out.get("dropped", 0))
    summary = {**asdict(result), "model": model, "dataset": cfg.dataset,
               "prompt_example": data.prompt_example, "prompts_filtered": data.filtered}
    (run_dir / "result.json").write_text(json.dumps(summary, indent=1))
    return result


def server_for(model: str, cfg: LLMConfig) -> Any:
    """An unstarted vLLM server for ``model`` with settings derived from ``cfg``."""
    return VLLMServer(placement.server_config(model, cfg))
