"""The toy ring's controller: ``run_ring(cfg)`` spawns, wires and runs the stages of
:mod:`grpo_nb.toy.actors`, then summarises; ``python -m grpo_nb toy``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from grpo_nb.config import preset, unique_run_name
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.ring import Controller, Event
from grpo_nb.toy.actors import Generator, Reference, Scorer, Trainer
from grpo_nb.toy.task import ToyConfig


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


async def run_ring(
    cfg: ToyConfig,
    recorder: MetricsRecorder | None = None,
    on_step: Callable[[MetricsRecorder], None] | None = None,
    *,
    stop_timeout_s: float = 10.0,
) -> RingResult:
    """Train ``cfg.steps`` steps (``on_step(recorder)`` after each), stop every actor; a summary."""
    ctl = Controller(cfg.backend, recorder, stop_timeout_s=stop_timeout_s)
    async with ctl:
        gen_procs = ctl.procs(cfg.generators)
        if cfg.layout == "per_role":
            trainer_procs, scorer_procs, ref_procs = ctl.procs(), ctl.procs(), ctl.procs()
        else:  # scorer, reference and trainer share one process
            trainer_procs = scorer_procs = ref_procs = ctl.procs()
        trainer = ctl.spawn(trainer_procs, "trainer", Trainer, cfg, ctl.metrics)
        weights = await trainer.snapshot.call_one()
        scorer = ctl.spawn(scorer_procs, "scorer", Scorer, cfg, ctl.metrics)
        reference = ctl.spawn(ref_procs, "reference", Reference, cfg, weights, ctl.metrics)
        gens = ctl.spawn(gen_procs, "generators", Generator, cfg, weights,
                         await scorer.inlet.call_one(), ctl.metrics)
        await ctl.wire(gens, scorer, reference, trainer)
        t0 = time.perf_counter()

        def relayed(event: Event) -> None:
            if event.kind == "step" and on_step is not None:
                on_step(ctl.rec)

        exited = await ctl.relay({"scorer", "reference", "trainer"}, on_event=relayed)
        wall = time.perf_counter() - t0
    return summarize(ctl.rec, cfg, wall, exited["trainer"].get("dropped", 0))


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
    args = parser.parse_args(argv)

    cfg = preset(ToyConfig, args.smoke or None)
    overrides = {"steps": args.steps, "generators": args.generators, "kl_coef": args.kl_coef}
    cfg = replace(cfg, seed=args.seed, backend=args.backend, **{k: v for k, v in overrides.items() if v is not None})
    if cfg.backend == "monarch":
        from grpo_nb.actors import MONARCH_MISSING, monarch_available

        if not monarch_available():
            print(MONARCH_MISSING, file=sys.stderr)
            return 2

    from tqdm.auto import tqdm

    from grpo_nb.live import save_figure

    name = args.name or unique_run_name(f"toy-{cfg.backend}")
    rec = MetricsRecorder.for_run(name)
    (rec.run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    bar = tqdm(total=cfg.steps, desc=f"toy ring ({cfg.backend})", unit="step", file=sys.stderr)

    def progress(r: MetricsRecorder) -> None:
        row = r.rows("step")[-1]
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward']:.2f}", kl=f"{row['kl']:.3f}", refresh=False)

    try:
        result = asyncio.run(run_ring(cfg, rec, progress))
    finally:
        bar.close()
        rec.close()
    png = save_figure(rec, rec.run_dir / "toy.png", optimum=cfg.optimum, random_reward=cfg.random_reward)
    print(json.dumps({**asdict(result), "png": str(png)}))
    return 0
