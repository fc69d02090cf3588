"""The async-vs-sync cost model of the toy ring, and the sweep that checks it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from grpo_nb.metrics import MetricsRecorder
from grpo_nb.toy.run import predict, run_ring, sweep_config, tail_sweep
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


def _train_overlap(rows: list[dict]) -> float:
    """Share of the trainer's busy time during which some generator was decoding too."""
    gen = [(r["start"], r["end"]) for r in rows if r["label"] == "generate"]
    train = [(r["start"], r["end"]) for r in rows if r["label"] == "train"]
    covered = 0.0
    for a, b in train:
        cuts = sorted((max(a, s), min(b, e)) for s, e in gen if s < b and e > a)
        reach = a
        for s, e in cuts:  # union of the generators' intervals inside [a, b]
            covered += max(0.0, e - max(s, reach))
            reach = max(reach, e)
    return covered / max(sum(b - a for a, b in train), 1e-9)


def test_async_overlaps_decoding_with_training_and_sync_does_not() -> None:
    """The schedule itself, from the actors' busy intervals: in async mode the generators
    decode while the trainer trains; in sync mode they wait for its credits. (Step times
    are the benchmark's business, ``benchmarks/toy_async.py``: on a loaded machine they
    measure the load.)"""
    base = sweep_config(steps=12, gen_delay_s=0.06, train_delay_s=0.06)
    overlap, stale = {}, {}
    for mode in ("sync", "async"):
        rec = MetricsRecorder(None)
        result = asyncio.run(asyncio.wait_for(run_ring(replace(base, mode=mode), rec), 120))
        overlap[mode], stale[mode] = _train_overlap(rec.rows("busy")), result.staleness_mean
    assert stale["sync"] == 0, "sync mode with weights to all is on-policy"
    assert stale["async"] > 0, stale
    # a quiet machine gives sync 0.0 and async about 0.9; the margins leave room for load
    assert overlap["sync"] < 0.1 and overlap["async"] > 0.4, overlap


def test_sweep_predicts_and_measures_both_modes() -> None:
    base = sweep_config(steps=8, gen_delay_s=0.02, train_delay_s=0.02)
    points = asyncio.run(asyncio.wait_for(tail_sweep(base, tails=(0.0, 1.5)), 120))
    for p in points:
        assert p.staleness_sync == 0 < p.staleness_async, p
        assert p.sync_step_s > 0 and p.async_step_s > 0, p
        assert p.predicted_sync_step_s > p.predicted_async_step_s, p
