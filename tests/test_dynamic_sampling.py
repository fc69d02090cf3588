"""DAPO's dynamic sampling in both rings, and the LLM ring's overlong handling; no vLLM server.

The LLM trainer's collection is driven with fake groups on a trainer built on a random model
(tests/llm_trainer.py, as tests/test_ring_bounded.py drives its finish path); the toy ring runs
end to end.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from llm_trainer import built_trainer

from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, Rollout
from grpo_nb.ring_core import DYNAMIC_DROP_CAP

pytestmark = pytest.mark.timeout(120)

# ── the LLM trainer's collection ──


def _fake(name: str, rewards: list[float], version: int = 3) -> SimpleNamespace:
    return SimpleNamespace(name=name, rewards=rewards, policy_version=version)


def _collect(t: Any) -> list[str]:
    t.ledger.dynamic.new_step()
    groups = asyncio.run(asyncio.wait_for(t.collect(t.cfg.prompts_per_step, t.keep), 5.0))
    return [g.name for g in groups]


def test_llm_collection_drops_equal_reward_groups_and_credits_replacements(
        random_model_dir) -> None:
    queued = [_fake("flat1", [1.0, 1.0]), _fake("mixed1", [0.0, 1.0]),
              _fake("stale-flat", [0.0, 0.0], version=0), _fake("flat0", [0.0, 0.0]),
              _fake("mixed2", [1.0, 0.5])]
    cfg = LLMConfig(prompts_per_step=2, group_size=2, max_staleness=1, dynamic_sampling=True)
    with built_trainer(random_model_dir, cfg, groups=queued, step=3) as t:
        assert _collect(t) == ["mixed1", "mixed2"]
        # each drop, stale or equal-reward, credited one more group, the moment it came
        led = t.ledger
        assert led.generators.totals == [3, 4, 5] and led.issued == 5 and led.received == 5
        assert led.stale == 1  # the stale one counts as stale, not as dynamic sampling's
        assert led.dynamic.row() == {"dynamic_dropped": 2, "dynamic_dropped_total": 2,
                                     "dynamic_capped": False}
    with built_trainer(random_model_dir, cfg.replace(dynamic_sampling=False),
                       groups=queued[:2], step=3) as off:
        assert _collect(off) == ["flat1", "mixed1"] and off.ledger.generators.told == []


def test_llm_collection_stops_dropping_at_the_cap_and_says_so(random_model_dir) -> None:
    """A task solved (or hopeless) for the policy: every group is flat. Past
    ``DYNAMIC_DROP_CAP × prompts_per_step`` drops the step takes what comes, flat or not."""
    cap = DYNAMIC_DROP_CAP * 1
    queued = [_fake(f"flat{i}", [1.0, 1.0]) for i in range(cap + 1)]
    cfg = LLMConfig(prompts_per_step=1, group_size=2, dynamic_sampling=True)
    with built_trainer(random_model_dir, cfg, groups=queued, step=3) as t:
        credits = t.ledger.generators
        assert _collect(t) == [f"flat{cap}"]
        assert credits.totals == [2, 3, 4] and t.ledger.dynamic.row() == {
            "dynamic_dropped": cap, "dynamic_dropped_total": cap, "dynamic_capped": True}
        for g in (_fake("flat", [0.0, 0.0]), _fake("mixed", [0.0, 1.0])):
            t.port.send(g)
        assert _collect(t) == ["mixed"]  # the next step counts afresh: it drops again
        assert credits.totals[3:] == [5] and t.ledger.dynamic.row() == {
            "dynamic_dropped": 1, "dynamic_dropped_total": cap + 1, "dynamic_capped": False}


def test_llm_step_rows_count_the_dropped_and_train_on_no_equal_reward_group(
        random_model_dir) -> None:
    """The trainer's loop with the torch step, syncs and evaluations stubbed out."""
    from grpo_nb import grpo

    cfg = LLMConfig(steps=2, prompts_per_step=2, group_size=2, dynamic_sampling=True,
                    time_budget_s=None)
    plan = [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.5, 1.0], [1.0, 0.0]]
    groups = [Group(i, "q", "7", [1], [Rollout([5], [-1.0], "", "stop", reward=r, token_versions=[0])
                                      for r in rewards],
                    0, t_submit=0.0, t_done=0.0) for i, rewards in enumerate(plan)]

    def step(batch: list[Group]) -> dict[str, Any]:
        t.pt.step_count += 1
        rewards = torch.tensor([r for g in batch for r in g.rewards])
        return {"step": t.pt.step_count, "zero_std_groups": grpo.zero_std_groups(rewards, 2)}

    async def nothing(*_: Any, **__: Any) -> None:
        return None

    with built_trainer(random_model_dir, cfg, groups=groups) as t:
        t.pt.step = step
        t.learner.sync = t.learner.evaluate = t._finish = nothing
        asyncio.run(asyncio.wait_for(t._train(t.ledger.generators), 10.0))
        rows = [r for r in t.rows if r["kind"] == "step"]
    assert [(r["zero_std_groups"], r["dynamic_dropped"], r["dynamic_dropped_total"],
             r["dynamic_capped"]) for r in rows] == [(0, 1, 1, False), (0, 2, 3, False)]


def test_dynamic_sampling_is_validated_by_name() -> None:
    from grpo_nb.toy.task import ToyConfig

    assert not LLMConfig().dynamic_sampling and not ToyConfig().dynamic_sampling
    with pytest.raises(ValueError, match="LLMConfig.dynamic_sampling"):
        LLMConfig(dynamic_sampling="yes")
    with pytest.raises(ValueError, match="ToyConfig.dynamic_sampling"):
        ToyConfig(dynamic_sampling=1)


# ── the toy ring, end to end ──


def _toy_rows(monkeypatch: pytest.MonkeyPatch, *, dynamic: bool,
              scorer: type | None = None) -> list[dict[str, Any]]:
    from grpo_nb.metrics import MetricsRecorder
    from grpo_nb.toy import run as toy_run
    from grpo_nb.toy.task import ToyConfig

    if scorer is not None:
        monkeypatch.setattr(toy_run, "Scorer", scorer)
    cfg = replace(ToyConfig(), steps=30, generators=2, eval_states=16, gen_delay_s=0.0,
                  dynamic_sampling=dynamic)
    rec = MetricsRecorder(None)
    asyncio.run(toy_run.run_ring(cfg, rec))
    return rec.rows("step")


def test_toy_ring_with_dynamic_sampling_trains_only_on_mixed_groups(monkeypatch) -> None:
    rows = _toy_rows(monkeypatch, dynamic=True)
    # the cap is far (12 drops a step; up to ~7 seen at this size), but the ring's timing
    # varies: a capped row, if any, says so and dropped the cap's worth
    capped = [r for r in rows if r["dynamic_capped"]]
    assert len(rows) == 30 and len(capped) <= 3
    assert all(r["dynamic_dropped"] == DYNAMIC_DROP_CAP * 4 for r in capped)
    assert all(r["zero_std_groups"] == 0 and r["zero_std_frac"] == 0.0
               for r in rows if not r["dynamic_capped"])
    dropped = [r["dynamic_dropped"] for r in rows]
    assert sum(dropped) > 0 and rows[-1]["dynamic_dropped_total"] == sum(dropped)
    # the same run without it does train on equal-reward groups
    plain = _toy_rows(monkeypatch, dynamic=False)
    assert sum(r["zero_std_groups"] for r in plain) > 0
    assert all(r["dynamic_dropped"] == 0 for r in plain)


def test_toy_ring_on_a_hopeless_task_hits_the_cap_every_step_and_still_trains(monkeypatch):
    from grpo_nb.toy.actors import Scorer

    class Hopeless(Scorer):  # no sample is ever right: every group is flat
        async def process(self, group: Any) -> Any:
            group = await super().process(group)
            group.rewards = torch.zeros_like(group.rewards)
            group.advantages = torch.zeros_like(group.advantages)
            return group

    rows = _toy_rows(monkeypatch, dynamic=True, scorer=Hopeless)
    per_step = 4  # ToyConfig.groups_per_step
    assert len(rows) == 30 and all(r["dynamic_capped"] for r in rows)
    assert all(r["dynamic_dropped"] == DYNAMIC_DROP_CAP * per_step for r in rows)
    assert all(r["zero_std_groups"] == per_step for r in rows)


# ── overlong handling ──


def test_overlong_penalty_is_dapos_linear_ramp() -> None:
    from grpo_nb.llm.rollouts import overlong_penalty

    # L_max = 8, L_cache = 4: 0 up to 4 tokens, then (4 - L) / 4, -1 at 8 and beyond
    got = [overlong_penalty(n, 8, 4) for n in range(11)]
    assert got == [0.0] * 5 + [-0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert overlong_penalty(7, 8, 1) == 0.0 and overlong_penalty(8, 8, 1) == -1.0


def _group() -> Group:
    """Four completions of a prompt whose answer is 7: right (2 tokens), right but long (6),
    wrong (3), and cut at max_tokens = 8 (finish "length", though its text starts right)."""
    cases = [("7", "stop", 2), ("7", "stop", 6), ("8", "stop", 3), ("7 and", "length", 8)]
    rollouts = [Rollout([5] * n, [-0.5] * n, text, finish) for text, finish, n in cases]
    return Group(0, "q", "7", [1, 2], rollouts, 0, t_submit=0.0, t_done=0.0)


def _cfg(overlong: str, **more: Any) -> LLMConfig:
    return LLMConfig(group_size=4, max_tokens=8, adv_scale="none", reward="exact",
                     overlong=overlong, **more)


@pytest.mark.parametrize(("overlong", "rewards", "masked"), [
    ("zero", [1.0, 1.0, 0.0, 0.0], [False] * 4),
    ("filter", [1.0, 1.0, 0.0, 0.0], [False, False, False, True]),
    # buffer 4: the 6-token one pays (4 - 6) / 4, the cut one -1 on top of its 0
    ("soft", [1.0, 0.5, 0.0, -1.0], [False] * 4),
])
def test_overlong_modes_set_rewards_advantages_and_masks(overlong, rewards, masked) -> None:
    from grpo_nb.llm.rollouts import score_group
    from grpo_nb.tasks import make_reward

    cfg = _cfg(overlong, **({"overlong_buffer": 4} if overlong == "soft" else {}))
    group = score_group(_group(), make_reward("exact"), cfg)
    mean = sum(rewards) / 4
    assert group.rewards == pytest.approx(rewards)
    assert group.advantages == pytest.approx([r - mean for r in rewards])
    assert [r.masked for r in group.rollouts] == masked


def test_the_llm_scorer_applies_the_overlong_mode() -> None:
    from grpo_nb.actors import Channel
    from grpo_nb.llm.actors import Scorer
    from grpo_nb.llm.data import RingSpec

    async def scored(cfg: LLMConfig) -> Group:
        scorer = Scorer(cfg, RingSpec("http://unused", "m", "unused", []), Channel.open()[0])
        try:
            return await scorer.process(_group())
        finally:
            await scorer.reward.close()

    soft = asyncio.run(scored(_cfg("soft", overlong_buffer=4)))
    assert soft.rewards == pytest.approx([1.0, 0.5, 0.0, -1.0])
    assert soft.advantages == pytest.approx([0.875, 0.375, -0.125, -1.125])
    filt = asyncio.run(scored(_cfg("filter")))
    assert [r.masked for r in filt.rollouts] == [False, False, False, True]


def test_filter_masks_the_truncated_rows_out_of_the_loss_only() -> None:
    from grpo_nb.llm.policy import _batch, make_batch

    group = _group()
    group.rollouts[3].masked = True
    batch = make_batch([group], pad_id=0)
    # prompt 2 tokens: completion token j of row i sits at shifted position 1 + j
    expected = torch.zeros(4, 9)
    for i, n in enumerate([2, 6, 3, 0]):
        expected[i, 1:1 + n] = 1.0
    assert torch.equal(batch.loss_mask, expected)
    assert batch.advantages.shape == (4,) and batch.input_ids.shape == (4, 10)
    # the log-prob path (reference, agreement checks) still sees every token
    assert _batch([(group.prompt_ids, r) for r in group.rollouts], 0).loss_mask[3].sum() == 8


@pytest.mark.parametrize(("changes", "message"), [
    ({"overlong": "clip"}, "LLMConfig.overlong='clip'"),
    ({"overlong": "soft", "max_tokens": 8, "overlong_buffer": 8}, "LLMConfig.overlong_buffer=8"),
    ({"overlong": "soft", "max_tokens": 8, "overlong_buffer": 0}, "LLMConfig.overlong_buffer=0"),
    ({"overlong": "soft", "max_tokens": 8, "overlong_buffer": 2.5},
     "LLMConfig.overlong_buffer=2.5"),
    ({"overlong": "soft", "max_tokens": 1}, "LLMConfig.overlong_buffer=1"),
    ({"overlong_buffer": 2}, "overlong_buffer=2 does nothing with overlong='zero'"),
])
def test_overlong_settings_are_validated_by_name(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMConfig(**changes).resolve()  # a buffer resolved from max_tokens is checked too


def test_soft_resolves_its_buffer_from_max_tokens() -> None:
    cfg = LLMConfig(overlong="soft", max_tokens=16).resolve()
    assert cfg.overlong_buffer == 4 and "overlong_buffer" in cfg.defaults
    assert cfg.replace(max_tokens=40).overlong_buffer == 10
    assert cfg.replace(overlong="zero").overlong_buffer is None
    assert LLMConfig(overlong="soft", max_tokens=16, overlong_buffer=3).overlong_buffer == 3
