"""Rollout groups against the real server, logprob agreement, and the command line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from grpo_nb.serving.client import ClientConfig, CompletionsClient
from grpo_nb.serving.rollouts import (
    LOGPROB_TOLERANCE,
    Group,
    Rollout,
    SamplingConfig,
    generate_groups,
    iter_groups,
    logprob_agreement,
    summarize,
)


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingConfig(max_tokens=0)
    with pytest.raises(ValueError, match="adv_scale"):
        SamplingConfig(adv_scale="mean")
    with pytest.raises(ValueError, match=r"SamplingConfig.reward='nope'.*unknown"):
        SamplingConfig(reward="nope")


def test_groups_are_scored_with_the_configured_reward(monkeypatch):
    """``SamplingConfig.reward`` is a make_reward spec: here the answer plus a format bonus."""
    from types import SimpleNamespace

    from grpo_nb.serving.rollouts import generate_group

    texts = iter(["7", "the sum is 7", "8"])

    async def post(self, body):
        return [SimpleNamespace(token_ids=[5], logprobs=[-1.0], text=next(texts),
                                finish_reason="stop", latency_s=0.0)]

    monkeypatch.setattr(CompletionsClient, "_post_with_retries", post)
    client = CompletionsClient("http://127.0.0.1:9/v1", "m")
    group = asyncio.run(generate_group(client, {"prompt": "q", "answer": "7"}, 3,
                                       prompt_ids=[1], sampling=SamplingConfig(
                                           reward="math+0.5*format")))
    assert group.rewards == [1.5, 1.0, 0.5]


def test_summarize_counts_correct_samples_and_mixed_groups():
    def group(gid, rewards):
        rs = [Rollout([1], [2, 3], [-0.1, -0.2], "x", "stop", r) for r in rewards]
        return Group(gid, "p", "a", [1], rs, 0, 0.0, 1.0)

    out = summarize([group(0, [1.0, 0.0]), group(1, [0.0, 0.0])], seconds=2.0)
    assert out["accuracy"] == 0.25 and out["mixed_groups"] == 1
    assert out["tokens"] == 8 and out["tokens_per_s"] == 4.0


@pytest.fixture(scope="module")
def test_rows(tiny_model_dir):
    from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset
    from grpo_nb.tiny_model import load_meta

    task = ArithmeticTaskConfig(**load_meta(tiny_model_dir)["config"]["task"])
    return list(make_dataset(task)["test"].select(range(12)))


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_groups_rewards_advantages_and_logprob_agreement(vllm_server, tiny_model_dir, test_rows):
    from grpo_nb.tasks import make_reward
    from grpo_nb.tiny_model import load_hf

    model, tok = load_hf(tiny_model_dir)
    reward = make_reward("math")  # SamplingConfig.reward's default

    async def go():
        async with CompletionsClient.for_server(vllm_server, ClientConfig(max_in_flight=16)) as c:
            groups = await generate_groups(c, test_rows, 6, tokenizer=tok,
                                           sampling=SamplingConfig(max_tokens=8, seed=1),
                                           policy_version=lambda: 7)
            return groups, c.stats

    groups, stats = asyncio.run(go())
    assert [g.group_id for g in groups] == list(range(len(test_rows)))
    assert stats.failed == 0 and stats.requests == 6 * len(test_rows)
    for g, row in zip(groups, test_rows, strict=True):
        assert g.prompt == row["prompt"] and len(g.rollouts) == 6 and g.policy_version == 7
        assert g.prompt_ids == tok.encode(row["prompt"], add_special_tokens=False)
        for r in g.rollouts:
            assert r.reward == reward(r.completion_text, row["answer"])
            assert len(r.sampler_logprobs) == len(r.completion_ids) >= 1
        adv = g.advantages
        assert abs(sum(adv)) < 1e-4  # group-relative: they sum to zero
        if len(set(g.rewards)) == 1:
            assert all(a == 0.0 for a in adv)
        else:
            best = max(range(6), key=lambda i: g.rewards[i])
            assert adv[best] > 0
    # The warm-started model is partly right: some groups carry signal.
    assert any(len(set(g.rewards)) > 1 for g in groups)
    agreement = logprob_agreement(model, groups)
    assert agreement["tokens"] == sum(g.n_tokens for g in groups)
    assert agreement["max_abs_diff"] < LOGPROB_TOLERANCE, agreement


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_failed_groups_are_dropped_and_counted_or_raised(vllm_server, tiny_model_dir, test_rows):
    """A prompt longer than the server's max length fails its group: skip counts it."""
    from grpo_nb.serving.client import CompletionError
    from grpo_nb.tiny_model import load_hf

    _, tok = load_hf(tiny_model_dir)
    too_long = {"prompt": "1+" * vllm_server.cfg.max_model_len + "1=", "answer": "0"}
    rows = [test_rows[0], too_long, test_rows[1]]

    async def go(on_error):
        async with CompletionsClient.for_server(vllm_server) as c:
            if on_error == "raise":
                with pytest.raises(CompletionError, match="HTTP 400"):
                    await generate_groups(c, rows, 2, tokenizer=tok, on_error="raise")
                return None, c.stats
            groups = [g async for g in iter_groups(c, rows, 2, tokenizer=tok, on_error="skip")]
            return groups, c.stats

    groups, stats = asyncio.run(go("skip"))
    assert sorted(g.group_id for g in groups) == [0, 2]
    assert stats.groups_dropped == 1 and stats.http_4xx >= 1
    _, stats = asyncio.run(go("raise"))
    assert stats.http_4xx >= 1


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_prints_json_last_attached_to_a_running_server(vllm_server, tiny_model_dir):
    """``--attach`` (a CLI that starts its own server is tested in test_llm_scale.py)."""
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_nb", "rollouts", "--smoke", "--model", str(tiny_model_dir),
         "--attach", vllm_server.url, "--groups", "4", "--group-size", "4"],
        capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["groups"] == 4 and result["samples"] == 16
    assert 0.0 < result["accuracy"] < 1.0  # warm start ≈ 30 %: 16 samples are not all 0 or 1
    assert result["tokens_per_s"] > 0 and result["failed_requests"] == 0
    assert result["max_abs_logprob_diff"] < LOGPROB_TOLERANCE
    assert vllm_server.healthy()  # attached: the CLI must not stop a server it did not start
