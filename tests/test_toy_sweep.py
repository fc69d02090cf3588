"""The async-vs-sync cost model of the toy ring, and the sweep that checks it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from grpo_nb.toy.sweep import predict, sweep_config, tail_sweep
from grpo_nb.toy.task import ToyConfig


def test_cost_model_speedup_is_two_for_balanced_phases_and_grows_with_the_tail() -> None:
    cfg = sweep_config()  # decode == train per step, one group per generator
    sync, async_ = predict(cfg)
    assert sync == pytest.approx(cfg.gen_delay_s + cfg.train_delay_s)
    assert async_ == pytest.approx(max(cfg.gen_delay_s, cfg.train_delay_s))
    speedups = [s / a for s, a in (predict(replace(cfg, gen_delay_tail=t)) for t in (0, 0.75, 1.5))]
    assert speedups[0] == pytest.approx(2.0)
    assert speedups[0] < speedups[1] < speedups[2]


def test_unbalanced_phases_leave_less_to_overlap() -> None:
    cfg = sweep_config()
    balanced = (lambda p: p[0] / p[1])(predict(cfg))
    heavy_train = (lambda p: p[0] / p[1])(predict(replace(cfg, train_delay_s=4 * cfg.gen_delay_s)))
    assert heavy_train == pytest.approx(1.25) and heavy_train < balanced


def test_a_negative_tail_is_rejected_naming_the_field() -> None:
    with pytest.raises(ValueError, match="gen_delay_tail"):
        ToyConfig(gen_delay_tail=-1)


def test_sweep_measures_async_faster_and_staler_than_sync() -> None:
    # Simulated phases 4x the ring's own per-step cost, so timing noise on a shared machine
    # cannot flip the comparison; a generous hang guard only.
    base = sweep_config(steps=16, gen_delay_s=0.06, train_delay_s=0.06)
    points = asyncio.run(asyncio.wait_for(tail_sweep(base, tails=(0.0, 1.5)), 120))
    for p in points:
        assert p.staleness_sync == 0, "max_lag=0 with weights to all is on-policy"
        assert p.staleness_async > 0
        assert p.speedup > 1.15, p
