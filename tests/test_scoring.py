"""The LLM Scorer rewards off the event loop, each completion within ``score_timeout_s``: a slow
reward leaves the loop free, a hanging one scores 0 and is counted, math-verify keeps its own
timeout (SIGALRM, main thread only) in the scoring process, and a reward's error is named."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import slow_rewards

from grpo_nb.llm.actors import Scorer
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, RingSpec, Rollout
from grpo_nb.tasks.scoring import RewardError

pytestmark = pytest.mark.timeout(120)

# by name: a child process; as a callable: a thread of its own
REWARDS = {"process": "slow_rewards:by_text", "thread": slow_rewards.by_text}


class Events(list):
    """A metrics port that keeps what the stage reports."""

    def send(self, event: Any) -> None:
        self.append(event)


def _scorer(reward: Any, **cfg: Any) -> tuple[Scorer, Events]:
    events = Events()
    spec = RingSpec("http://unused", "m", "unused", [])
    return Scorer(LLMConfig(group_size=2, reward=reward, **cfg), spec, events), events


def _group(texts: list[str], answer: str = "7") -> Group:
    rollouts = [Rollout([2], [-1.0], t, "stop") for t in texts]
    return Group(0, "q", answer, [1], rollouts, 0, 0.0, 0.0)


def _score(scorer: Scorer, group: Group, during: Any = None) -> Any:
    async def main() -> Any:
        try:
            await scorer.reward.score([("0", "0")])  # the child started: not what is timed
            return await scorer.process(group) if during is None else await during(group)
        finally:
            await scorer.reward.close()

    return asyncio.run(main())


@pytest.mark.parametrize("where", REWARDS)
def test_a_slow_reward_leaves_the_event_loop_free(where):
    scorer, _ = _scorer(REWARDS[where])

    async def ticking(group: Group) -> tuple[Group, float]:
        gaps, last = [], time.monotonic()

        async def tick() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)  # ticking
        try:
            scored = await scorer.process(group)
            await asyncio.sleep(0.05)  # a stall ends in a gap the ticker records now
            return scored, max(gaps)
        finally:
            ticker.cancel()

    group, gap = _score(scorer, _group(["sleep:4", "7"]), ticking)
    assert group.rewards == [1.0, 1.0]
    assert gap < 2.0, f"the loop stalled {gap:.1f} s while a reward slept 4 s"


@pytest.mark.parametrize("where", REWARDS)
def test_a_hanging_reward_scores_0_within_the_bound_and_is_counted(where):
    from grpo_nb.llm.summary import summarize
    from grpo_nb.metrics import MetricsRecorder

    scorer, events = _scorer(REWARDS[where], score_timeout_s=1.0)
    pids: list[int] = []

    async def timed(group: Group) -> tuple[Group, float]:
        if scorer.reward.proc is not None:
            pids.append(scorer.reward.proc.pid)
        t0 = time.monotonic()
        return await scorer.process(group), time.monotonic() - t0

    group, seconds = _score(scorer, _group(["hang", "7", "8", "7"]), timed)
    assert group.rewards == [0.0, 1.0, 0.0, 1.0]  # the ones after the hang: scored
    assert seconds < 20.0  # the reward hangs 30 s
    (row,) = [e.data for e in events if e.kind == "score_timeout"]
    assert row["total"] == 1 and row["completion"] == "hang" and row["bound_s"] == 1.0
    for pid in pids:  # the process that hung was killed
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    rec = MetricsRecorder(None)
    rec.log("score_timeout", **row)  # as the controller records the event
    assert summarize(rec, LLMConfig(), 1.0, 0).score_timeouts == 1


def test_math_verify_keeps_its_own_timeout_in_the_scoring_process():
    """The child scores on its main thread, where SIGALRM works: math-verify's 1 s timeout cuts
    a 5 s sleep; the real math reward gives the same answers there as here."""
    scorer, _ = _scorer("slow_rewards:alarm_fires+math")

    async def both(group: Group) -> list[float | None]:
        return await scorer.reward.score([("x", "1"), ("\\boxed{\\frac{1}{2}}", "0.5"),
                                          ("\\boxed{x^2+2x}", "x(x+2)")])

    assert _score(scorer, _group([]), both) == [1.0, 2.0, 2.0]


@pytest.mark.parametrize("where", REWARDS)
def test_an_error_in_the_reward_is_raised_with_its_message(where):
    scorer, _ = _scorer(REWARDS[where])
    with pytest.raises((RewardError, ValueError), match="boom: this reward fails"):
        _score(scorer, _group(["7", "boom"]))
