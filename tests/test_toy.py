"""The toy GRPO ring on the asyncio runtime: it learns, it is reproducible, it stops cleanly."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import replace

import pytest
import torch

import grpo_nb.actors
import grpo_nb.ring
from grpo_nb.actors import Channel, this_proc
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.toy.actors import Scorer
from grpo_nb.toy.run import cli, run_ring
from grpo_nb.toy.task import Group, ToyConfig


@pytest.fixture
def cancelled_loops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per stage loop that ``ring.cancel_task`` cancels (every actor's __cleanup__)."""
    cancelled: list[int] = []
    original = grpo_nb.ring.cancel_task

    async def counting_cancel(task: asyncio.Task | None, *, quiet: bool = False) -> None:
        cancelled.append(1)
        await original(task, quiet=quiet)

    monkeypatch.setattr(grpo_nb.ring, "cancel_task", counting_cancel)
    return cancelled


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="ToyConfig.generators"):
        ToyConfig(generators=0)
    with pytest.raises(ValueError, match="ToyConfig.clip"):
        ToyConfig(clip=1.5)
    with pytest.raises(ValueError, match="ToyConfig.backend"):
        ToyConfig(backend="threads")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ToyConfig.adv_scale"):
        ToyConfig(adv_scale="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ToyConfig.mode"):
        ToyConfig(mode="lockstep")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ToyConfig.max_ahead"):
        ToyConfig(max_ahead=-1)


@pytest.mark.parametrize("scale", ["std", "none"])
def test_scorer_sets_rewards_and_the_group_advantages(scale: str) -> None:
    cfg = replace(ToyConfig.smoke(), generators=1, adv_scale=scale)
    acts = torch.arange(cfg.group_size) % cfg.arms  # every arm: some samples pay, some do not

    async def main() -> Group:
        metrics, _ = Channel.open()
        out, inbox = Channel.open()
        scorer = this_proc().spawn("scorer", Scorer, cfg, metrics)
        try:
            await scorer.start.call_one(out)
            port = await scorer.inlet.call_one()
            port.send(Group(torch.randn(cfg.obs_dim), acts, torch.zeros(cfg.group_size), 0, "gen0", 0.0))
            return await inbox.recv()
        finally:
            await scorer.stop()

    group = asyncio.run(main())
    centred = group.rewards - group.rewards.mean()
    assert 0 < group.rewards.sum() < cfg.group_size
    expected = centred if scale == "none" else centred / (group.rewards.std() + 1e-6)
    assert torch.allclose(group.advantages, expected), (group.rewards, group.advantages)


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_credits_bound_the_run_ahead(ahead: int) -> None:
    """Instant generators and a slow trainer: the generators run as far ahead as their credits
    allow and no further, so with weights to all every group is exactly ``max_ahead`` stale."""
    cfg = replace(ToyConfig.smoke(), steps=8, gen_delay_s=0.0, train_delay_s=0.02,
                  selection="all", max_ahead=ahead)
    rec = MetricsRecorder(None)
    asyncio.run(asyncio.wait_for(run_ring(cfg, rec), 60))
    late = rec.rows("step")[ahead + 1:]  # once the first 1 + max_ahead steps' worth is used
    assert {s for r in late for s in r["staleness"]} == {ahead}
    assert max(r["queue_depth"] for r in rec.rows("step")) <= ahead * cfg.groups_per_step


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ring_learns_towards_the_optimum(seed: int) -> None:
    cfg = replace(ToyConfig.smoke(), seed=seed, steps=60)
    rec = MetricsRecorder(None)
    result = asyncio.run(asyncio.wait_for(run_ring(cfg, rec), 120))
    assert result.steps == 60
    assert result.first_reward < 0.5, "a fresh policy should be near random (1/arms = 0.25)"
    assert result.last_reward > result.first_reward + 0.25, result
    exp = rec.series("step", "expected_reward")
    assert exp[-1] > exp[0] + 0.3, (exp[0], exp[-1])
    assert result.expected_reward_final <= cfg.optimum
    # every step recorded what the notebooks plot
    row = rec.rows("step")[-1]
    for key in ("reward", "loss", "kl", "clip_frac", "staleness", "queue_depth"):
        assert key in row
    assert len(row["staleness"]) == cfg.groups_per_step and min(row["staleness"]) >= 0
    # the diagnostics: entropy starts near the uniform policy's ln(arms) and falls as it
    # learns; the fraction of groups with all rewards equal is that count over the groups
    entropy = rec.series("step", "entropy")
    assert math.log(cfg.arms) >= entropy[0] > 0.5 * math.log(cfg.arms) > entropy[-1] > 0, entropy
    for r in rec.rows("step"):
        assert r["zero_std_frac"] == r["zero_std_groups"] / cfg.groups_per_step
    actors = {r["actor"] for r in rec.rows("busy")}
    assert {"gen0", "gen3", "scorer", "reference", "trainer"} <= actors


def test_one_generator_on_policy_is_deterministic() -> None:
    cfg = replace(ToyConfig.smoke(), generators=1, mode="sync", steps=15, seed=7, gen_delay_s=0.0)

    def once() -> MetricsRecorder:
        rec = MetricsRecorder(None)
        asyncio.run(asyncio.wait_for(run_ring(cfg, rec), 60))
        return rec

    a, b = once(), once()
    for key in ("reward", "loss", "kl", "expected_reward"):
        assert a.series("step", key) == b.series("step", key), key
    assert {s for r in a.rows("step") for s in r["staleness"]} == {0}


def test_more_generators_make_samples_staler() -> None:
    def staleness(k: int) -> float:
        cfg = replace(ToyConfig.smoke(), generators=k, steps=30, seed=0)
        return asyncio.run(asyncio.wait_for(run_ring(cfg), 60)).staleness_mean

    assert staleness(4) > staleness(1)


def test_cancelling_a_running_ring_stops_every_actor_quickly(cancelled_loops: list[int]) -> None:
    async def main() -> float:
        started = asyncio.Event()

        def on_step(rec: MetricsRecorder) -> None:
            if len(rec.rows("step")) >= 3:
                started.set()

        ring = asyncio.create_task(run_ring(replace(ToyConfig(), steps=10_000), on_step=on_step))
        await asyncio.wait_for(started.wait(), 60)
        t0 = time.perf_counter()
        ring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ring
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(0)
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert leftovers == [], leftovers
        return elapsed

    elapsed = asyncio.run(main())
    # a hang guard, under the 10 s stop timeout: no actor waited it out
    assert elapsed < 8.0, f"shutdown took {elapsed:.2f}s"
    assert len(cancelled_loops) >= 7, "every actor's __cleanup__ must run (4 generators + 3 stages)"


def test_cli_writes_metrics_png_and_a_json_summary(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path))
    assert cli(["--smoke", "--steps", "12", "--generators", "2", "--name", "t"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["steps"] == 12 and summary["backend"] == "asyncio"
    run_dir = tmp_path / "t"
    assert (run_dir / "metrics.jsonl").stat().st_size > 0
    assert (run_dir / "toy.png").read_bytes()[:4] == b"\x89PNG"


def test_monarch_backend_missing_gives_a_clear_message(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "monarch.actor", None)  # makes `import monarch.actor` fail
    assert not grpo_nb.actors.monarch_available()
    with pytest.raises(RuntimeError, match="torchmonarch is not installed"):
        grpo_nb.actors.backend("monarch")
    assert cli(["--smoke", "--backend", "monarch"]) == 2
    err = capsys.readouterr().err
    assert "torchmonarch is not installed" in err and "Traceback" not in err


def test_keyboard_interrupt_in_the_controller_still_stops_every_actor(cancelled_loops: list[int]) -> None:
    """A notebook interrupt lands in controller code (here: the on_step callback)."""
    def on_step(rec: MetricsRecorder) -> None:
        if len(rec.rows("step")) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(run_ring(replace(ToyConfig.smoke(), steps=10_000), on_step=on_step))
    assert len(cancelled_loops) >= 7
