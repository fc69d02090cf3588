"""When does asynchrony pay? The toy ring in ``mode="sync"`` vs ``"async"`` as decode time grows
a heavy tail, against a cost model (``K`` generators, ``c`` the ring's own cost per step)::

    predicted sync step  ≈ E[max over generators of its groups' decode time] + train + c
    predicted async step ≈ max(E[one generator's decode time per step], train + c)
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from grpo_nb.metrics import MetricsRecorder
from grpo_nb.toy.run import run_ring
from grpo_nb.toy.task import ToyConfig, decode_time

if TYPE_CHECKING:
    from matplotlib.figure import Figure


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
    import matplotlib.pyplot as plt

    tails = [p.tail for p in points]
    fig, (ax_s, ax_st) = plt.subplots(1, 2, figsize=(10, 3.2))
    ax_s.plot(tails, [p.speedup for p in points], "o-", label="measured")
    ax_s.plot(tails, [p.predicted_speedup for p in points], "s--", label="cost model")
    ax_s.axhline(1.0, color="grey", lw=0.8)
    ax_s.set(xlabel="tail of generation time (log-normal σ)", ylabel="sync ÷ async step time",
             title="async speed-up")
    ax_s.legend()
    ax_st.plot(tails, [p.staleness_sync for p in points], "o-", label="sync")
    ax_st.plot(tails, [p.staleness_async for p in points], "o-", label="async")
    ax_st.set(xlabel="tail of generation time (log-normal σ)", ylabel="mean staleness",
              title="what it costs: staleness")
    ax_st.legend()
    fig.tight_layout()
    return fig
