"""Asynchronous (or synchronous) GRPO on the tiny Qwen3 model, served by vLLM with weight sync.

The controller of the LLM ring (:mod:`grpo_nb.llm_ring`) and ``python -m grpo_nb train``::

    train(cfg) ──► tiny model folder (tiny_model.build_or_load) ──► VLLMServer (+ gloo engine)
        │                                                                  │
        ├─► run_ring(): spawn actors, relay their events into MetricsRecorder rows,
        │       watch the server (dies → RunAborted within a second or two), Stop → drain
        ▼
    runs/<name>/  metrics.jsonl, config.json, checkpoint/, dashboard.png ──► RunResult

The server is started (and always stopped) here unless the caller passes one, which is how
notebook 05 runs the async and the sync mode against the same server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from grpo_nb.config import runs_dir, smoke_mode
from grpo_nb.llm_config import LLMConfig
from grpo_nb.llm_ring import Event, RingSpec, actor_classes
from grpo_nb.metrics import MetricsRecorder

__all__ = ["LLMConfig", "RunAborted", "RunResult", "cli", "run_ring", "train"]


class RunAborted(RuntimeError):
    """The ring could not go on (server died, an actor failed); the message says why."""


@dataclass
class RunResult:
    """The summary the CLI prints as its last line (plus a few extras)."""

    steps: int
    accuracy_before: float
    accuracy_after: float
    wall_s: float
    sync_ms_mean: float
    stale_dropped: int
    weights_verified: bool
    mode: str = ""
    staleness_mean: float = math.nan
    tokens_per_s: float = math.nan
    run_dir: str | None = None


def load_prompts(tokenizer: Any, smoke: bool) -> tuple[list[tuple[list[int], str]], Any]:
    """Train prompts as ``(token ids, answer)`` and the test set as fixed-length tensors."""
    import torch

    from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset

    ds = make_dataset(ArithmeticTaskConfig.smoke() if smoke else ArithmeticTaskConfig())

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    train = [(enc(p), a) for p, a in zip(ds["train"]["prompt"], ds["train"]["answer"],
                                         strict=True)]
    test = ds["test"]
    prompts = torch.tensor([enc(p) for p in test["prompt"]])
    answers = torch.tensor([enc(a) + [tokenizer.eos_token_id] for a in test["answer"]])
    return train, (prompts, answers)


async def _stop_meshes(meshes: list[Any], timeout_s: float) -> None:
    for mesh in meshes:
        try:
            await asyncio.wait_for(asyncio.ensure_future(_await(mesh.stop())), timeout_s)
        except (Exception, TimeoutError) as err:
            print(f"warning: stopping {mesh!r} failed: {err!r}", file=sys.stderr)


async def _await(fut: Any) -> Any:
    return await fut


def _server_gone(server: Any) -> str | None:
    if server is None or server.is_running():
        return None
    code = server.proc.returncode if getattr(server, "proc", None) is not None else "?"
    return f"the vLLM server at {server.url} exited (code {code})"


async def _wait_server_gone(server: Any, grace_s: float = 3.0) -> str | None:
    """Like :func:`_server_gone`, but waits up to ``grace_s`` for a dying server to exit.

    A killed server first shows up as a failed request in some actor, a moment before its
    process has exited; waiting lets the error name the real cause.
    """
    deadline = time.monotonic() + grace_s
    while (gone := _server_gone(server)) is None and server is not None:
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    return gone


async def run_ring(cfg: LLMConfig, spec: RingSpec, rec: MetricsRecorder, *, server: Any = None,
                   on_event: Any = None, stop: Any = None, backend: str = "asyncio",
                   stop_timeout_s: float = 15.0) -> dict[str, Any]:
    """Spawn the ring, relay its events into ``rec`` until the trainer exits; stop all actors.

    ``on_event(kind, rec)`` runs on the controller after each relayed event (live plots,
    progress bars). ``stop`` is anything with ``is_set()``: when set, the trainer finishes
    its step, drains, syncs, evaluates and checkpoints. Raises :class:`RunAborted`.
    """
    from grpo_nb.actors import backend as actor_backend

    api = actor_backend(backend)
    ring = actor_classes(api)
    offset = rec.now() - time.time()  # actors stamp wall-clock time; rows use recorder time
    meshes: list[Any] = []
    exited: dict[str, Any] = {}
    try:
        proc = api.this_proc()
        metrics, inbox = api.Channel.open()
        trainer = proc.spawn("trainer", ring.Trainer, cfg, spec, metrics)
        scorer = proc.spawn("scorer", ring.Scorer, cfg, metrics)
        reference = proc.spawn("reference", ring.Reference, cfg, spec, metrics)
        meshes += [trainer, scorer, reference]
        gen_procs = api.this_host().spawn_procs(per_host={"gpus": cfg.generators})
        gens = gen_procs.spawn("generators", ring.Generator, cfg, spec,
                               await scorer.inlet.call_one(), metrics)
        meshes.insert(0, gens)
        await trainer.start.call_one(gens)
        await reference.start.call_one(await trainer.inlet.call_one())
        await scorer.start.call_one(await reference.inlet.call_one())
        await gens.start.call()
        stop_sent = False
        while "trainer" not in exited:
            if stop is not None and stop.is_set() and not stop_sent:
                await trainer.request_stop.call_one()
                stop_sent = True
            if (gone := _server_gone(server)) is not None:
                raise RunAborted(f"{gone}: run aborted at step "
                                 f"{len(rec.rows('step'))}")
            try:
                event: Event = await asyncio.wait_for(inbox.recv(), timeout=0.5)
            except TimeoutError:
                continue
            if event.kind == "busy":
                for actor, label, start, end in event.data:
                    rec.log("busy", t=end + offset, actor=actor, label=label,
                            start=start + offset, end=end + offset)
            elif event.kind == "exited":
                exited[event.data["actor"]] = event.data
            elif event.kind == "error":
                gone = await _wait_server_gone(server)
                raise RunAborted(f"{gone + ': ' if gone else ''}ring actor "
                                 f"{event.data['actor']} failed: {event.data['error']}\n"
                                 f"{event.data['traceback']}")
            else:
                rec.log(event.kind, **event.data)
            if on_event is not None:
                on_event(event.kind, rec)
    finally:
        await _stop_meshes(meshes, stop_timeout_s)
    return exited["trainer"]


def summarize(rec: MetricsRecorder, cfg: LLMConfig, wall_s: float, dropped: int) -> RunResult:
    evals = rec.rows("eval")
    syncs = rec.rows("sync")
    steps = rec.rows("step")
    stale = [s for r in steps for s in r.get("staleness", [])]
    tokens = sum(r.get("tokens", 0) for r in steps)
    last_sync = syncs[-1] if syncs else {}
    return RunResult(
        steps=steps[-1]["step"] if steps else 0,
        accuracy_before=evals[0]["accuracy"] if evals else math.nan,
        accuracy_after=evals[-1]["accuracy"] if evals else math.nan,
        wall_s=round(wall_s, 2),
        sync_ms_mean=round(statistics.fmean(r["ms"] for r in syncs), 1) if syncs else math.nan,
        stale_dropped=dropped,
        weights_verified=bool(last_sync.get("verified")) and
        last_sync.get("step") == (steps[-1]["step"] if steps else 0),
        mode=cfg.mode,
        staleness_mean=round(statistics.fmean(stale), 3) if stale else math.nan,
        tokens_per_s=round(tokens / wall_s, 1) if wall_s > 0 else math.nan,
        run_dir=str(rec.run_dir) if rec.run_dir else None,
    )


async def train(cfg: LLMConfig, *, model_dir: str | Path | None = None, name: str | None = None,
                resume: str | Path | None = None, server: Any = None, on_event: Any = None,
                stop: Any = None, backend: str = "asyncio", smoke: bool | None = None,
                progress: bool = True) -> RunResult:
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
    from grpo_nb.serving import ServerConfig, VLLMServer

    scfg = ServerConfig.smoke(model_dir)
    for key, value in cfg.sync.server_settings().items():
        setattr(scfg, key, value)
    return VLLMServer(scfg).start(progress=progress)


def cli(argv: list[str]) -> int:
    """``python -m grpo_nb train``: headless run, progress bar, PNG, JSON summary last."""
    parser = argparse.ArgumentParser(prog="python -m grpo_nb train",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small CI preset (or GRPO_NB_SMOKE=1)")
    parser.add_argument("--mode", choices=["async", "sync"], help="default: async")
    parser.add_argument("--model", help="model folder (default: the tiny Qwen3, built if needed)")
    parser.add_argument("--resume", help="a run folder (runs/<name>) to continue from")
    parser.add_argument("--steps", type=int, help="total optimiser steps")
    parser.add_argument("--time-budget", type=float, help="seconds of training at most")
    parser.add_argument("--transport", choices=["gloo", "reload", "nccl", "ipc"],
                        help="weight sync: gloo/reload on CPU, nccl/ipc on GPU")
    parser.add_argument("--name", help="run folder name under runs/")
    args = parser.parse_args(argv)
    smoke = args.smoke or smoke_mode()
    cfg = LLMConfig.smoke() if smoke else LLMConfig()
    changes: dict[str, Any] = {}
    if args.resume:
        saved = json.loads((Path(args.resume) / "config.json").read_text())
        cfg = LLMConfig(**saved)
    if args.mode:
        changes["mode"] = args.mode
    if args.steps:
        changes["steps"] = args.steps
    if args.time_budget:
        changes["time_budget_s"] = args.time_budget
    if args.transport:
        from grpo_nb.weight_sync import WeightSyncConfig

        changes["sync"] = WeightSyncConfig(**{**asdict(cfg.sync), "transport": args.transport})
    cfg = cfg.replace(**changes)

    from tqdm.auto import tqdm

    from grpo_nb.dashboard import save_dashboard

    bar = tqdm(total=cfg.steps, desc=f"GRPO {cfg.mode}", unit="step")

    def on_event(kind: str, rec: MetricsRecorder) -> None:
        if kind == "step":
            row = rec.rows("step")[-1]
            bar.n = row["step"]
            bar.set_postfix(reward=f"{row['reward']:.2f}", dropped=row.get("dropped", 0))
        elif kind == "eval":
            bar.write(f"step {rec.rows('eval')[-1]['step']}: test accuracy "
                      f"{rec.rows('eval')[-1]['accuracy']:.3f}")

    try:
        result = asyncio.run(train(cfg, model_dir=args.model, name=args.name,
                                   resume=args.resume, on_event=on_event, smoke=smoke))
    except RunAborted as err:
        bar.close()
        print(f"error: {err}", file=sys.stderr)
        return 1
    bar.close()
    if result.run_dir:
        png = save_dashboard(result.run_dir)
        print(f"dashboard: {png}", file=sys.stderr)
    print(json.dumps(asdict(result)))
    return 0
