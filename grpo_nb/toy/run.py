"""The toy ring's controller: ``run_ring(cfg)`` spawns, wires and runs the stages of
:mod:`grpo_nb.toy.actors`, then summarises; ``python -m grpo_nb toy``.

When does asynchrony pay? :func:`tail_sweep` runs the ring in ``mode="sync"`` and ``"async"`` as
decode time grows a heavy tail, against a cost model (``K`` generators, ``c`` the ring's own cost
per step)::

    predicted sync step  ≈ E[max over generators of its groups' decode time] + train + c
    predicted async step ≈ max(E[one generator's decode time per step], train + c)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from grpo_nb.actors import MONARCH_MISSING, monarch_available
from grpo_nb.config import given_fields, parse_sets, preset, unique_run_name
from grpo_nb.live import StepBar, save_figure
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.partition import torch_settings
from grpo_nb.ring import Controller, Event
from grpo_nb.toy.actors import Generator, Reference, Scorer, Trainer
from grpo_nb.toy.task import ToyConfig, build_policy, decode_time


@dataclass
class RingResult:
    """Summary figures of a finished ring run."""

    backend: str
    steps: int
    wall_s: float
    steps_per_s: float
    optimum: float
    random_reward: float
    first_reward: float  # mean sampled reward over the first 10% of steps
    last_reward: float  # ... and over the last 10%
    expected_reward_final: float
    staleness_mean: float
    staleness_max: int
    dropped: int
    run_dir: str | None = None


def summarize(rec: MetricsRecorder, cfg: ToyConfig, wall_s: float, dropped: int = 0) -> RingResult:
    steps = rec.rows("step")
    rewards = [r["reward"] for r in steps]
    k = max(1, len(rewards) // 10)
    stale = [s for r in steps for s in r["staleness"]]
    return RingResult(
        backend=cfg.backend,
        steps=len(steps),
        wall_s=round(wall_s, 3),
        steps_per_s=round(len(steps) / wall_s, 2) if wall_s > 0 else 0.0,
        optimum=cfg.optimum,
        random_reward=cfg.random_reward,
        first_reward=round(statistics.fmean(rewards[:k]), 4) if rewards else math.nan,
        last_reward=round(statistics.fmean(rewards[-k:]), 4) if rewards else math.nan,
        expected_reward_final=round(steps[-1]["expected_reward"], 4) if steps else math.nan,
        staleness_mean=round(statistics.fmean(stale), 3) if stale else math.nan,
        staleness_max=max(stale, default=0),
        dropped=dropped,
        run_dir=str(rec.run_dir) if rec.run_dir else None,
    )


async def run_ring(cfg: ToyConfig, recorder: MetricsRecorder | None = None,
                   on_step: Callable[[MetricsRecorder], None] | None = None) -> RingResult:
    """Train ``cfg.steps`` steps (``on_step(recorder)`` after each), stop every actor; a summary.
    Torch runs one intra-op thread meanwhile (the caller's count is restored after): the toy's
    tensors are tiny, and on a loaded 2-core machine a second thread waiting for a busy core
    made the ring 4-9x slower (60 steps: 15-32 s against 3.4 s)."""
    with torch_settings(threads=1):
        weights = build_policy(cfg, seed=cfg.seed).state_dict()  # the trainer's first weights
        async with Controller(cfg.backend, recorder, stop_timeout_s=10.0) as ctl:
            roles = ("trainer", "scorer", "reference")
            if cfg.layout == "per_role":
                procs = {role: ctl.procs() for role in roles}
            else:  # scorer, reference and trainer share one process
                procs = dict.fromkeys(roles, ctl.procs())
            stages = {"generators": Generator, "scorer": Scorer, "reference": Reference,
                      "trainer": Trainer}
            args = {"generators": (cfg, weights), "scorer": (cfg,), "reference": (cfg, weights),
                    "trainer": (cfg,)}
            await ctl.start_ring(stages, args, generators=cfg.generators, procs=procs)
            t0 = time.perf_counter()

            def relayed(event: Event) -> None:
                if event.kind == "step" and on_step is not None:
                    on_step(ctl.rec)

            exited = await ctl.relay(set(roles), on_event=relayed)
            wall = time.perf_counter() - t0
    return summarize(ctl.rec, cfg, wall, exited["trainer"].get("dropped", 0))


@dataclass
class SweepPoint:
    """One tail setting: measured and predicted seconds per step in each mode."""

    tail: float
    sync_step_s: float
    async_step_s: float
    predicted_sync_step_s: float
    predicted_async_step_s: float
    staleness_sync: float
    staleness_async: float

    @property
    def speedup(self) -> float:
        return self.sync_step_s / self.async_step_s

    @property
    def predicted_speedup(self) -> float:
        return self.predicted_sync_step_s / self.predicted_async_step_s


def sweep_config(steps: int = 30, generators: int = 4, gen_delay_s: float = 0.04,
                 train_delay_s: float = 0.04, seed: int = 0) -> ToyConfig:
    """Balanced phases (one group per generator per step; decode ≈ train) on the smoke sizes."""
    return replace(ToyConfig.smoke(), steps=steps, generators=generators,
                   groups_per_step=generators, gen_delay_s=gen_delay_s,
                   train_delay_s=train_delay_s, selection="all", seed=seed)


def predict(cfg: ToyConfig, overhead_s: float = 0.0, samples: int = 4000,
            seed: int = 0) -> tuple[float, float]:
    """(sync, async) seconds per step from the cost model above (Monte Carlo over the
    log-normal decode times); ``overhead_s`` is ``c``, see :func:`measure_overhead`."""
    rng = random.Random(seed)
    per_gen = math.ceil(cfg.groups_per_step / cfg.generators)
    slowest = [max(sum(decode_time(cfg, rng.gauss(0, 1)) for _ in range(per_gen))
                   for _ in range(cfg.generators)) for _ in range(samples)]
    sync = statistics.fmean(slowest) + cfg.train_delay_s + overhead_s
    if cfg.max_ahead == 0:  # no credits beyond the current step: async mode runs as sync
        return sync, sync
    return sync, max(per_gen * cfg.gen_delay_s, cfg.train_delay_s + overhead_s)


def _step_time(rec: MetricsRecorder) -> float:
    """Median seconds between consecutive trainer steps, after the first (the ring's start)."""
    t = [row["t"] for row in rec.rows("step")]
    gaps = [b - a for a, b in zip(t[1:], t[2:], strict=False)]
    return statistics.median(gaps) if gaps else math.nan


async def measure_overhead(base: ToyConfig) -> float:
    """``c``: seconds per step of the ring itself (synchronous, no simulated delays)."""
    rec = MetricsRecorder(None)
    await run_ring(replace(base, gen_delay_s=0.0, train_delay_s=0.0, gen_delay_tail=0.0,
                           mode="sync"), rec)
    return _step_time(rec)


async def tail_sweep(base: ToyConfig, tails: tuple[float, ...] = (0.0, 0.75, 1.5),
                     overhead_s: float | None = None) -> list[SweepPoint]:
    """Run ``base`` in both modes at each tail setting; measured against predicted with
    ``overhead_s`` as ``c`` (measured here when not given)."""
    overhead = await measure_overhead(base) if overhead_s is None else overhead_s
    points = []
    for tail in tails:
        cfg = replace(base, gen_delay_tail=tail)
        measured = {}
        for mode in ("sync", "async"):
            rec = MetricsRecorder(None)
            result = await run_ring(replace(cfg, mode=mode), rec)
            measured[mode] = (_step_time(rec), result.staleness_mean)
        sync_pred, async_pred = predict(cfg, overhead)
        points.append(SweepPoint(tail, measured["sync"][0], measured["async"][0], sync_pred,
                                 async_pred, measured["sync"][1], measured["async"][1]))
    return points


def sweep_figure(points: list[SweepPoint]) -> Figure:
    """Speed-up (measured and predicted) and the staleness it costs, against the tail."""
    tails = [p.tail for p in points]
    fig, (ax_s, ax_st) = plt.subplots(1, 2, figsize=(10, 3.2))
    ax_s.plot(tails, [p.speedup for p in points], "o-", label="measured")
    ax_s.plot(tails, [p.predicted_speedup for p in points], "s--", label="cost model")
    ax_s.axhline(1.0, color="grey", lw=0.8)
    ax_s.set(ylabel="sync ÷ async step time", title="async speed-up")
    ax_st.plot(tails, [p.staleness_sync for p in points], "o-", label="sync")
    ax_st.plot(tails, [p.staleness_async for p in points], "o-", label="async")
    ax_st.set(ylabel="mean staleness", title="what it costs: staleness")
    for ax in (ax_s, ax_st):
        ax.set(xlabel="tail of generation time (log-normal σ)")
        ax.legend()
    fig.tight_layout()
    return fig


def cli(argv: list[str]) -> int:
    """``python -m grpo_nb toy``: run the ring with a progress bar, write metrics + PNG."""
    parser = argparse.ArgumentParser(prog="python -m grpo_nb toy", description="Run the toy GRPO ring.")
    parser.add_argument("--steps", type=int, help="trainer steps (default: the preset's)")
    parser.add_argument("--generators", type=int, help="number of generator actors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["asyncio", "monarch"], default="asyncio")
    parser.add_argument("--kl-coef", type=float, help="KL coefficient")
    parser.add_argument("--smoke", action="store_true", help="the small CI preset (also GRPO_NB_SMOKE=1)")
    parser.add_argument("--name", help="run folder name under runs/ (default: toy-<backend>-<time>)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="any ToyConfig field (repeatable), e.g. --set lr=0.05; last wins")
    args = parser.parse_args(argv)

    try:
        cfg = replace(preset(ToyConfig, args.smoke or None), **{
            **given_fields(args, ToyConfig), **parse_sets(ToyConfig, args.set)})
    except ValueError as err:
        parser.error(str(err))
    if cfg.backend == "monarch" and not monarch_available():
        print(MONARCH_MISSING, file=sys.stderr)
        return 2

    rec = MetricsRecorder.for_run(args.name or unique_run_name(f"toy-{cfg.backend}"))
    (rec.run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    bar = StepBar(cfg.steps, f"toy ring ({cfg.backend})", reward=".2f", kl=".3f")
    try:
        result = asyncio.run(run_ring(cfg, rec, lambda r: bar.step(r.rows("step")[-1])))
    finally:
        bar.close()
        rec.close()
    png = save_figure(rec, rec.run_dir / "toy.png", optimum=cfg.optimum, random_reward=cfg.random_reward)
    print(json.dumps({**asdict(result), "png": str(png)}))
    return 0
