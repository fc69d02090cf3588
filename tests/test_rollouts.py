"""The one sampler (the ring's, notebook 04's, the rollouts CLI's) against fakes and the real
server, log-prob agreement, and the command line."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys

import pytest
from fake_vllm import scripted

from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, Prompt, Rollout
from grpo_nb.llm.rollouts import (
    LOGPROB_TOLERANCE,
    logprob_agreement,
    sample_group,
    sample_groups,
    summarize,
)
from grpo_nb.serving.client import ClientConfig, CompletionsClient


def _fake_server(fake, replies):
    """A client of ``fake`` answering each request with the next list of (text,
    finish_reason); the bodies sent: ``fake.sampled``."""
    fake.sampler = scripted(replies)
    return CompletionsClient(fake.base_url, "m")


def test_groups_are_rewarded_with_the_given_reward_and_cut_completions_score_0(fake_vllm):
    from grpo_nb.tasks import make_reward

    client = _fake_server(fake_vllm, [[("7", "stop"), ("the sum is 7", "stop"),
                                       ("8", "stop"), ("7", "length")]])
    cfg = LLMConfig(group_size=4).resolve()
    (group,) = asyncio.run(sample_groups(client, [Prompt("q", [1], "7")], cfg,
                                         reward=make_reward("math+0.5*format")))
    assert group.rewards == [1.5, 1.0, 0.5, 0.0]
    sent = fake_vllm.sampled
    assert len(sent) == 1 and sent[0]["sampling_params"]["n"] == 4
    assert sent[0]["cache_salt"] == "policy-v0"


def test_an_aborted_group_is_sampled_again_at_the_new_version(fake_vllm):
    """A group cut short by a sync is not a sample of one policy: dropped, counted, resampled
    with the version then served (and its salt)."""
    client = _fake_server(fake_vllm, [[("7", "abort"), ("7", "stop")],
                                      [("7", "stop"), ("8", "stop")]])
    versions, aborted = iter([3, 4]), []
    group = asyncio.run(sample_group(client, Prompt("q", [1], "7"), LLMConfig(group_size=2).resolve(),
                                     lambda: next(versions), on_abort=lambda: aborted.append(1)))
    assert aborted == [1] and group.policy_version == 4
    assert [b["cache_salt"] for b in fake_vllm.sampled] == ["policy-v3", "policy-v4"]
    assert [r.finish_reason for r in group.rollouts] == ["stop", "stop"]


def test_a_group_carries_its_prompt_ids_id_and_version_once(fake_vllm):
    """The Rollouts of a sampled group hold only their own completion: the group's pickled size
    (what every hop of the ring sends) grows by the same bytes per completion for a 3-token and
    a 600-token prompt."""
    client = CompletionsClient(fake_vllm.base_url, "m")  # each completion: one token, "7"

    def pickled(prompt_len: int, group_size: int) -> int:
        cfg = LLMConfig(group_size=group_size).resolve()
        group = asyncio.run(sample_group(client, Prompt("q", [3] * prompt_len, "7"), cfg,
                                         lambda: 2, group_id=5))
        assert (group.prompt_ids, group.group_id, group.policy_version) == ([3] * prompt_len, 5, 2)
        for r in group.rollouts:
            r.latency_s = 0.0  # measured: its float's bytes vary
        return len(pickle.dumps(group))

    assert pickled(600, 8) - pickled(600, 2) == pickled(3, 8) - pickled(3, 2)
    assert not {"prompt_ids", "group_id", "policy_version"} & set(vars(Rollout([5], [-1.0], "",
                                                                              "stop")))


def test_summarize_counts_correct_samples_and_mixed_groups():
    def group(gid, rewards):
        rs = [Rollout([2, 3], [-0.1, -0.2], "x", "stop", r) for r in rewards]
        return Group(gid, "p", "a", [1], rs, 0, 0.0, 1.0)

    out = summarize([group(0, [1.0, 0.0]), group(1, [0.0, 0.0])], seconds=2.0)
    assert out["accuracy"] == 0.25 and out["mixed_groups"] == 1
    assert out["tokens"] == 8 and out["tokens_per_s"] == 4.0


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_logprob_agreement_compares_at_the_sampling_temperature(temperature):
    """The server's processed log-probs are ``log_softmax(logits / T)``: sampler log-probs made
    that way agree at their own ``T`` (what ``rollouts --temperature T`` checks) and not at
    another one."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=23, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32))
    with torch.no_grad():  # a head far from uniform: temperatures differ by far more than 1e-4
        model.lm_head.weight.normal_(0.0, 1.0)
    prompt, groups = [3, 4, 5], []
    for gid, completions in enumerate([[[6, 7, 1], [8, 2]], [[9, 9, 9, 1]]]):
        rollouts = []
        for c in completions:
            ids = torch.tensor([prompt + c])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0, :-1].float() / temperature, -1)
            at = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
            rollouts.append(Rollout(c, lp[at, ids[0, at + 1]].tolist(), "", "stop"))
        groups.append(Group(gid, "p", "a", prompt, rollouts, 0, 0.0, 1.0))

    same = logprob_agreement(model, groups, temperature=temperature)
    assert same["tokens"] == 9 and same["max_abs_diff"] < LOGPROB_TOLERANCE, same
    other = logprob_agreement(model, groups, temperature=temperature * 1.3)
    assert other["max_abs_diff"] > 100 * LOGPROB_TOLERANCE, other


@pytest.fixture(scope="module")
def test_prompts(tiny_model_dir):
    from grpo_nb.llm.data import render_prompts
    from grpo_nb.llm.policy import load_policy
    from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset
    from grpo_nb.tiny_model import load_meta

    task = ArithmeticTaskConfig(**load_meta(tiny_model_dir)["config"]["task"])
    rows = list(make_dataset(task)["test"].select(range(12)))
    return render_prompts(load_policy(tiny_model_dir)[1], rows, 256)[0]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_groups_rewards_and_logprob_agreement(vllm_server, tiny_model_dir, test_prompts):
    from grpo_nb.llm.policy import load_policy
    from grpo_nb.tasks import make_reward

    model, tok = load_policy(tiny_model_dir)
    reward = make_reward("exact")
    cfg = LLMConfig(group_size=6, max_tokens=8)

    async def go():
        async with CompletionsClient.for_server(vllm_server, ClientConfig(max_in_flight=4)) as c:
            return await sample_groups(c, test_prompts, cfg, reward=reward, seed=1), c.stats

    groups, stats = asyncio.run(go())
    assert [g.group_id for g in groups] == list(range(len(test_prompts)))
    assert stats.failed == 0 and stats.requests == len(test_prompts)  # one request a group
    for g, p in zip(groups, test_prompts, strict=True):
        assert g.prompt == p.text and g.prompt_ids == p.ids and len(g.rollouts) == 6
        for r in g.rollouts:
            assert r.reward == (reward(r.completion_text, p.answer)
                                if r.finish_reason == "stop" else 0.0)
            assert len(r.sampler_logprobs) == len(r.completion_ids) >= 1
    # The warm-started model is partly right: some groups carry signal.
    assert any(len(set(g.rewards)) > 1 for g in groups)
    agreement = logprob_agreement(model, groups, temperature=cfg.temperature)
    assert agreement["tokens"] == sum(g.n_tokens for g in groups)
    assert agreement["max_abs_diff"] < LOGPROB_TOLERANCE, agreement


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_failed_group_raises_and_cancels_the_others(vllm_server, test_prompts):
    """A prompt longer than the server's max length fails its request: the error is raised."""
    from grpo_nb.serving.client import CompletionError

    too_long = Prompt("x", [5] * (vllm_server.cfg.max_model_len + 1), "0")

    async def go():
        async with CompletionsClient.for_server(vllm_server) as c:
            with pytest.raises(CompletionError, match="HTTP 400"):
                await sample_groups(c, [test_prompts[0], too_long, test_prompts[1]],
                                    LLMConfig(group_size=2).resolve())
            return c.stats

    assert asyncio.run(go()).http_4xx >= 1


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_prints_json_last_attached_to_a_running_server(vllm_server, tiny_model_dir):
    """``--attach`` (a CLI that starts its own server is tested in test_llm_scale.py), at a
    temperature other than 1: the log-probs are compared at the one sampled at. HTTP_PROXY,
    HTTPS_PROXY and ALL_PROXY (both cases) point at a dead port and NO_PROXY is unset: every
    loopback call of the CLI bypasses the proxy (test_loopback_proxy.py)."""
    from test_loopback_proxy import proxied_env

    proc = subprocess.run(
        [sys.executable, "-m", "grpo_nb", "rollouts", "--smoke", "--model", str(tiny_model_dir),
         "--attach", vllm_server.url, "--groups", "4", "--group-size", "4",
         "--temperature", "0.7"],
        capture_output=True, text=True, timeout=800, env=proxied_env(dict(os.environ)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["groups"] == 4 and result["samples"] == 16
    assert 0.0 < result["accuracy"] < 1.0  # warm start ≈ 30 %: 16 samples are not all 0 or 1
    assert result["tokens_per_s"] > 0 and result["failed_requests"] == 0
    assert result["max_abs_logprob_diff"] < LOGPROB_TOLERANCE and result["temperature"] == 0.7
    assert vllm_server.healthy()  # attached: the CLI must not stop a server it did not start


def test_logprob_tolerance_is_derived_from_the_dtype_and_holds_for_cpu_bf16() -> None:
    """fp32 keeps 1e-4; bf16's bound is 2 · ROUNDINGS · 2^-8 · LOGIT_MAX / T. A CPU bf16
    forward (AVX512-BF16 / AMX kernels) of an 8-layer Qwen3 with logits ≈ 10 against its fp32
    forward: the logit error stays within ROUNDINGS roundings of max |z|, and the completion
    log-probs within the bound at T = 1 and T = 0.7."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from grpo_nb.llm import rollouts as ro

    assert ro.logprob_tolerance("float32") == ro.LOGPROB_TOLERANCE == 1e-4
    assert ro.logprob_tolerance("float32", 0.7) == 1e-4
    assert ro.logprob_tolerance("bfloat16") == pytest.approx(1.0)
    assert ro.logprob_tolerance("bfloat16", 0.5) == pytest.approx(2.0)
    assert ro.logprob_tolerance("bfloat16", 0.0) == pytest.approx(1.0)  # greedy: T = 1
    with pytest.raises(ValueError, match="dtype='float16'"):
        ro.logprob_tolerance("float16")

    torch.manual_seed(0)
    hidden = 128
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=128)).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 2.0 / hidden ** 0.5)  # logits ≈ 10, not ≈ 1
        ids = torch.randint(0, 512, (6, 40))
        z32 = model(ids).logits.float()
        bf16 = Qwen3ForCausalLM(model.config).eval()
        bf16.load_state_dict(model.state_dict())
        bf16 = bf16.to(torch.bfloat16)
        z16 = bf16(ids).logits.float()
    assert z32.abs().max() > 5
    dz = (z32 - z16).abs().max()
    assert dz > ro.BF16_UNIT_ROUNDOFF * z32.abs().max()  # more than the logit's own rounding
    assert dz <= ro.ROUNDINGS * ro.BF16_UNIT_ROUNDOFF * z32.abs().max(), dz
    prompt = ids[0, :8].tolist()
    for temperature in (1.0, 0.7):
        group_rollouts = []
        for row in ids:
            seq = torch.tensor([prompt + row[8:].tolist()])
            with torch.no_grad():  # the "server": bf16, its processed log-probs at T
                lp = torch.log_softmax(bf16(seq).logits[0, :-1].float() / temperature, -1)
            at = torch.arange(len(prompt) - 1, seq.shape[1] - 1)
            group_rollouts.append(Rollout(row[8:].tolist(), lp[at, seq[0, at + 1]].tolist(),
                                          "", "stop"))
        groups = [Group(0, "p", "a", prompt, group_rollouts, 0, 0.0, 1.0)]
        got = logprob_agreement(model, groups, temperature=temperature, dtype="bfloat16")
        bound = 2 * dz / temperature  # the softmax step of the derivation, on these logits
        assert got["tolerance"] == ro.logprob_tolerance("bfloat16", temperature)
        assert 10 * LOGPROB_TOLERANCE < got["max_abs_diff"] <= bound <= got["tolerance"], got
