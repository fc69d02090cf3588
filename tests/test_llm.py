"""The LLM ring: config validation, the trainer's step and checkpoints, and real runs.

Runs use a randomly initialised tiny Qwen3 (weights, schedule, sync and shutdown are what is
tested here; learning is measured by ``python -m grpo_nb train``, see the report). Server
starts: one shared by the ring tests (the kill test, last to use it, kills it) and one owned
by the CLI.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, Rollout
from grpo_nb.llm.policy import PolicyTrainer, load_policy, make_batch

# ── config ──


@pytest.mark.parametrize(("changes", "field"), [
    ({"group_size": 1}, "group_size"),
    ({"max_inflight": 4, "group_size": 8}, "max_inflight"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"prompts_per_step": 6, "grad_accum": 4}, "prompts_per_step"),
    ({"mode": "turbo"}, "mode"),
    ({"loss_agg": "sum"}, "loss_agg"),
    ({"steps": 0}, "steps"),
    ({"num_iterations": 0}, "num_iterations"),
    ({"lr": 0.0}, "lr"),
    # off-policy: combinations that could never admit a group, or that would do nothing
    ({"sync_every": 4, "max_staleness": 2}, "sync_every=4 > max_staleness"),
    ({"tis_cap": 2.0, "ratio_against": "sampler"},
     "tis_cap=2.0 with ratio_against='sampler' does nothing"),
    ({"ratio_against": "trainer"}, "ratio_against='trainer' needs tis_cap"),
    ({"ratio_against": "trainer", "tis_cap": 0.0}, "tis_cap"),
    ({"clip_low": 1.0}, "clip_low"),
    ({"clip_high": -0.1}, "clip_high"),
    ({"dual_clip": 1.1}, "dual_clip"),
    ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"error_budget": -1}, "error_budget"),
    ({"adv_scale": "mean"}, "LLMConfig.adv_scale"),
])
def test_bad_config_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        LLMConfig(**changes)


def test_staleness_at_the_limit_of_the_sync_interval_is_accepted() -> None:
    """sync_every = max_staleness + 1: the freshest group just before a sync is admissible."""
    assert LLMConfig(sync_every=3, max_staleness=2).sync_every == 3
    assert LLMConfig(ratio_against="trainer", tis_cap=2.0).tis_cap == 2.0


def test_admission_keeps_groups_up_to_max_staleness_and_replaces_the_dropped(
        random_model_dir) -> None:
    """``admit`` is the rule; the trainer drops an older group (counted) and issues one more
    credit in its place, so the step still gets its groups."""
    from types import SimpleNamespace

    from llm_trainer import built_trainer

    from grpo_nb.llm.actors import admit

    assert admit(5, 3, 2) and admit(5, 5, 0) and not admit(5, 2, 2)
    queued = [SimpleNamespace(policy_version=v, rewards=[0.0, 1.0]) for v in (2, 1, 3)]
    cfg = LLMConfig(prompts_per_step=2, max_staleness=1)  # at step 3, version 1 is too old
    with built_trainer(random_model_dir, cfg, groups=queued, step=3, issued=2) as t:
        groups = asyncio.run(asyncio.wait_for(t.collect(2, t.keep), 5.0))
        assert [g.policy_version for g in groups] == [2, 3]
        assert (t.ledger.stale, t.ledger.issued, t.ledger.generators.told) == (1, 3, [(3, 3)])
        assert [r["kind"] for r in t.rows] == ["dropped"]


def test_scorer_sets_rewards_then_advantages_at_the_configured_scale() -> None:
    """``adv_scale="std"`` divides by the group's std (GRPO); ``"none"`` only centres
    (Dr. GRPO); a completion cut at max_tokens scores 0."""
    from grpo_nb.actors import Channel
    from grpo_nb.llm.actors import Scorer
    from grpo_nb.llm.data import RingSpec

    def scored(scale: str) -> list[float]:
        scorer = Scorer(LLMConfig(group_size=4, adv_scale=scale, reward="exact"),
                        RingSpec("http://unused", "m", "unused", []), Channel.open()[0])
        group = _group([1], [[5]] * 4, [0.0] * 4)
        group.answer = "7"
        for r, (text, finish) in zip(group.rollouts, [("7", "stop"), ("7", "stop"),
                                                      ("8", "stop"), ("7", "length")],
                                     strict=True):
            r.completion_text, r.finish_reason = text, finish

        async def score() -> Group:
            try:
                return await scorer.process(group)
            finally:
                await scorer.reward.close()

        out = asyncio.run(score())
        assert out.rewards == [1.0, 1.0, 0.0, 0.0]
        return out.advantages

    assert scored("none") == pytest.approx([0.5, 0.5, -0.5, -0.5])
    assert scored("std") == pytest.approx([0.866, 0.866, -0.866, -0.866], abs=1e-3)


def test_generators_salt_each_request_with_its_policy_version() -> None:
    """vLLM reuses cached prompt KV only under the same salt: without it, after a sync without
    /pause, a new request could start from KV the old weights computed."""
    from grpo_nb.llm.rollouts import sampling_request
    from grpo_nb.serving.client import policy_salt

    cfg = LLMConfig().resolve()
    assert cfg.sync.pause_mode == "none"  # the ring's default: such syncs happen
    v3, v4 = sampling_request(cfg, 3), sampling_request(cfg, 4)
    assert v3["cache_salt"] == policy_salt(3) != v4["cache_salt"] == policy_salt(4)
    assert v3["n"] == cfg.group_size and v3["max_tokens"] == cfg.max_tokens


def test_smoke_preset_is_smaller_and_valid() -> None:
    full, smoke = LLMConfig(), LLMConfig.smoke()
    assert smoke.steps < full.steps and smoke.eval_size <= full.eval_size
    assert LLMConfig(**{**full.to_dict(), "mode": "sync"}).sync.transport == "gloo"


# ── trainer, no server ──


def _group(prompt: list[int], completions: list[list[int]], rewards: list[float],
           version: int = 0) -> Group:
    from grpo_nb.grpo import group_advantages

    adv = group_advantages(torch.tensor(rewards), len(rewards)).tolist()
    rollouts = [Rollout(c, [-1.0] * len(c), "", "stop", r, a)
                for c, r, a in zip(completions, rewards, adv, strict=True)]
    return Group(0, "", "", prompt, rollouts, version, 0.0, 0.0)


def test_make_batch_pads_and_masks_only_completion_tokens() -> None:
    g = _group([3, 4, 5], [[6, 1], [7, 8, 1]], [1.0, 0.0])
    b = make_batch([g], pad_id=0)
    assert b.input_ids.tolist() == [[3, 4, 5, 6, 1, 0], [3, 4, 5, 7, 8, 1]]
    # position t predicts token t+1: completion tokens sit at 3.. → mask from index 2
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert b.sampler_logprobs[0].tolist() == [0, 0, -1, -1, 0]
    assert b.advantages.tolist()[0] > 0 > b.advantages.tolist()[1]


def test_trainer_step_moves_probability_towards_rewarded_completion(random_model_dir) -> None:
    from grpo_nb.grpo import sequence_logprobs

    model, tok = load_policy(random_model_dir)
    cfg = LLMConfig(prompts_per_step=2, group_size=2, grad_accum=2, lr=1e-2,
                    ratio_against="trainer", tis_cap=2.0)
    pt = PolicyTrainer(model, tok, cfg)
    good, bad = [6, 7, 1], [8, 9, 1]
    groups = [_group([3, 4, 5], [good, bad], [1.0, 0.0]), _group([3, 4, 5], [bad, good],
                                                                  [0.0, 1.0])]
    b = make_batch(groups[:1], tok.pad_token_id)

    def margin() -> float:
        with torch.no_grad():
            lp = (sequence_logprobs(model, b.input_ids, b.attention_mask, 1.0) * b.loss_mask)
        return float(lp[0].sum() - lp[1].sum())

    before = margin()
    for _ in range(3):
        row = pt.step(groups)
    assert margin() > before + 0.1
    assert row["step"] == 3 and row["reward"] == 0.5 and row["grad_norm"] > 0


def test_step_row_reports_entropy_truncation_and_groups_without_signal(random_model_dir) -> None:
    """The practitioner's diagnostics in the step row: the entropy of the distributions the
    completion tokens were drawn from (at the sampling temperature, prompt and padding left
    out, a token-mean over micro-batches whatever loss_agg weighs), the fraction cut at
    max_tokens, the fraction of groups with all rewards equal, the mean completion length."""
    from grpo_nb.grpo import next_token_logits

    model, tok = load_policy(random_model_dir)
    cfg = LLMConfig(prompts_per_step=2, group_size=2, grad_accum=2, temperature=0.7,
                    loss_agg="seq-mean-token-mean")
    pt = PolicyTrainer(model, tok, cfg)
    mixed = _group([3, 4, 5], [[6, 7, 1], [8, 9, 10, 11]], [1.0, 0.0])
    mixed.rollouts[1].finish_reason = "length"  # cut at max_tokens
    flat = _group([3, 4], [[6, 1], [7, 1]], [0.0, 0.0])  # no signal: zero advantages
    b = make_batch([mixed, flat], tok.pad_token_id)
    with torch.no_grad():  # float64 entropy of softmax(logits / T) before the step's update
        p = torch.softmax(next_token_logits(model, b.input_ids, b.attention_mask).double()
                          / 0.7, -1)
    per_token = -(p * p.log()).sum(-1)
    completion, real = b.loss_mask.bool(), b.attention_mask[:, 1:].bool()
    row = pt.step([mixed, flat])
    assert row["entropy"] == pytest.approx(float(per_token[completion].mean()), rel=1e-5)
    assert row["entropy"] != pytest.approx(float(per_token[real].mean()), rel=1e-4)
    assert row["truncated_frac"] == 0.25 and row["response_len"] == (3 + 4 + 2 + 2) / 4
    assert row["zero_std_groups"] == 1 and row["zero_std_frac"] == 0.5


def test_summary_reports_entropy_at_both_ends_and_the_diagnostics_means() -> None:
    from grpo_nb.llm.summary import summarize
    from grpo_nb.metrics import MetricsRecorder

    rec = MetricsRecorder()
    for step, (entropy, flat, cut, length) in enumerate([(2.5, 0.0, 0.5, 10.0),
                                                         (1.0, 0.5, 0.25, 20.0),
                                                         (0.1, 1.0, 0.0, 30.0)], 1):
        rec.log("step", step=step, entropy=entropy, zero_std_frac=flat, truncated_frac=cut,
                response_len=length)
    r = summarize(rec, LLMConfig(), 1.0, 0)
    assert (r.entropy_start, r.entropy_end) == (2.5, 0.1)
    assert (r.zero_std_frac_mean, r.truncated_frac_mean, r.response_len_mean) == (0.5, 0.25, 20.0)
    empty = summarize(MetricsRecorder(), LLMConfig(), 1.0, 0)  # no step: unknown, not 0
    assert math.isnan(empty.entropy_start) and math.isnan(empty.truncated_frac_mean)


def test_checkpoint_round_trip(random_model_dir, tmp_path: Path) -> None:
    model, tok = load_policy(random_model_dir)
    cfg = LLMConfig(prompts_per_step=1, group_size=2)
    pt = PolicyTrainer(model, tok, cfg)
    pt.step([_group([3, 4], [[5, 1], [6, 1]], [1.0, 0.0])])
    pt.save(tmp_path / "ckpt", {"dropped": 3})
    other = PolicyTrainer(load_policy(random_model_dir)[0], tok, cfg)
    saved = other.load(tmp_path / "ckpt")
    assert saved["dropped"] == 3 and other.step_count == 1
    for a, b in zip(model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert other.opt.state_dict()["state"].keys() == pt.opt.state_dict()["state"].keys()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_non_finite_loss_skips_the_step_and_leaves_weights_alone(random_model_dir,
                                                                  monkeypatch) -> None:
    model, tok = load_policy(random_model_dir)
    pt = PolicyTrainer(model, tok, LLMConfig(prompts_per_step=1, group_size=2, lr=1e-2))
    groups = [_group([3, 4], [[5, 1], [6, 1]], [1.0, 0.0])]
    before = _params(model)
    real = pt._micro_loss
    monkeypatch.setattr(pt, "_micro_loss", lambda *a: (real(*a)[0] * math.nan, {}))
    row = pt.step(groups)
    assert row["skipped"] == "loss=nan" and row["skipped_steps"] == 1 and pt.step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not pt.opt.state  # the optimiser never stepped (no moments from a NaN gradient)
    monkeypatch.setattr(pt, "_micro_loss", real)
    assert "skipped" not in pt.step(groups) and pt.step_count == 1


def test_non_finite_gradient_skips_the_step(random_model_dir, monkeypatch) -> None:
    model, tok = load_policy(random_model_dir)
    pt = PolicyTrainer(model, tok, LLMConfig(prompts_per_step=1, group_size=2))
    before = _params(model)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(math.inf))
    row = pt.step([_group([3, 4], [[5, 1], [6, 1]], [1.0, 0.0])])
    assert row["skipped"] == "grad_norm=inf" and pt.step_count == 0 and pt.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_num_iterations_updates_each_batch_that_often_against_the_first_policy(
        random_model_dir) -> None:
    """GRPO's μ: μ optimiser updates per step, one step counted. With the trainer as the "old"
    policy, the first update's ratio is exactly 1 and later ones compare with the policy
    before the step's first update, so the ratio moves and the clip acts."""
    groups = [_group([3, 4, 5], [[6, 7, 1], [8, 9, 1]], [1.0, 0.0]),
              _group([3, 4], [[6, 1], [9, 1]], [0.0, 1.0])]
    rows = {}
    for mu in (1, 3):
        model, tok = load_policy(random_model_dir)
        cfg = LLMConfig(prompts_per_step=2, group_size=2, grad_accum=2, lr=5e-2,
                        ratio_against="trainer", tis_cap=2.0, num_iterations=mu)
        pt = PolicyTrainer(model, tok, cfg)
        rows[mu] = pt.step(groups)
        assert pt.step_count == 1 and rows[mu]["updates"] == mu
        assert {int(st["step"]) for st in pt.opt.state.values()} == {mu}
    assert rows[1]["ratio_mean"] == 1.0 and rows[1]["clip_frac"] == 0.0
    assert rows[3]["ratio_mean"] != pytest.approx(1.0, abs=1e-3) and rows[3]["clip_frac"] > 0


def test_a_non_finite_later_update_keeps_the_updates_made(random_model_dir,
                                                          monkeypatch) -> None:
    model, tok = load_policy(random_model_dir)
    pt = PolicyTrainer(model, tok, LLMConfig(prompts_per_step=1, group_size=2, lr=1e-2,
                                             num_iterations=3))
    before = _params(model)
    real, calls = pt._update, []

    def second_fails(*args):
        calls.append(1)
        return ("loss=nan", {}, math.nan) if len(calls) == 2 else real(*args)

    monkeypatch.setattr(pt, "_update", second_fails)
    row = pt.step([_group([3, 4], [[5, 1], [6, 1]], [1.0, 0.0])])
    assert len(calls) == 2 and row["updates"] == 1 and "skipped" not in row
    assert pt.step_count == 1 and pt.skipped == 0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-sum-norm", "seq-mean-token-mean",
                                      "token-mean"])
def test_gradient_does_not_depend_on_grad_accum(random_model_dir, loss_agg: str) -> None:
    """Micro-batches of different widths and lengths: the summed gradient is the batch's."""
    groups = [_group([3, 4, 5], [[6, 7, 8, 9, 1], [8, 1]], [1.0, 0.0]),
              _group([3, 4], [[6, 1], [9, 1]], [0.0, 1.0])]
    grads = []
    for accum in (1, 2):
        model, tok = load_policy(random_model_dir)
        cfg = LLMConfig(prompts_per_step=2, group_size=2, grad_accum=accum, loss_agg=loss_agg,
                        max_grad_norm=1e9, max_tokens=8)
        PolicyTrainer(model, tok, cfg).step(groups)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()
                                if p.grad is not None]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def _crash(*args, **kwargs) -> None:
    raise RuntimeError("crash")


def test_checkpoint_survives_a_crash_while_being_replaced(random_model_dir, tmp_path: Path,
                                                          monkeypatch) -> None:
    """A crash while writing, or just before the switch: the previous one still loads."""
    from grpo_nb.llm import policy

    model, tok = load_policy(random_model_dir)
    cfg = LLMConfig(prompts_per_step=1, group_size=2)
    pt = PolicyTrainer(model, tok, cfg)
    pt.save(tmp_path / "checkpoint", {"mark": "first"})
    pt.step([_group([3, 4], [[5, 1], [6, 1]], [1.0, 0.0])])
    for where in ("write", "switch"):
        with monkeypatch.context() as m:
            if where == "write":  # the optimizer state is written after the model
                m.setattr(torch, "save", _crash)
            else:  # everything written and renamed, the link not yet switched
                m.setattr(policy.os, "replace", _crash)
            with pytest.raises(RuntimeError, match="crash"):
                pt.save(tmp_path / "checkpoint", {"mark": "second"})
        other = PolicyTrainer(load_policy(random_model_dir)[0], tok, cfg)
        assert other.load(tmp_path / "checkpoint")["mark"] == "first" and other.step_count == 0
    pt.save(tmp_path / "checkpoint", {"mark": "third"})  # and a later save cleans up
    assert PolicyTrainer(load_policy(random_model_dir)[0], tok, cfg).load(
        tmp_path / "checkpoint")["mark"] == "third"
    assert len(list(tmp_path.glob("ckpt-*"))) == 1


# ── the controller's watchers, no server ──


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_server_watch_ends_the_relay_when_the_server_process_exits() -> None:
    """No polling: the watcher wakes when the process exits, and names the server."""
    from types import SimpleNamespace

    from grpo_nb.llm.run import RunAborted, ServerWatch
    from grpo_nb.ring import Controller

    proc = _sleeper()
    server = SimpleNamespace(proc=proc, url="http://127.0.0.1:1")

    async def main() -> float:
        watch = ServerWatch(server)
        assert await watch.gone_within(0.2) is None  # alive: no blame after the grace
        asyncio.get_running_loop().call_later(0.3, proc.kill)
        start = time.monotonic()
        try:
            with pytest.raises(RunAborted, match=r"vLLM server at http://127.0.0.1:1 exited "
                                                 r"\(code -9\): run aborted at step 7"):
                relay = Controller().relay({"trainer"}, watchers=[watch.died(lambda: 7)])
                await asyncio.wait_for(relay, 5.0)  # a watcher that never fires: fail, not hang
        finally:
            watch.close()
        assert await watch.gone_within(0.0) is not None  # dead: named at once
        return time.monotonic() - start

    try:
        assert asyncio.run(main()) < 2.0
    finally:
        proc.kill()
        proc.wait()


def test_error_explained_by_a_server_that_dies_within_the_grace() -> None:
    """An actor error that arrives before the server process is gone still blames it."""
    from types import SimpleNamespace

    from grpo_nb.llm.run import ServerWatch

    proc = _sleeper()

    async def main() -> str | None:
        watch = ServerWatch(SimpleNamespace(proc=proc, url="http://s"))
        asyncio.get_running_loop().call_later(0.5, proc.kill)
        try:
            return await watch.gone_within(5.0)
        finally:
            watch.close()

    try:
        assert asyncio.run(main()) == "the vLLM server at http://s exited (code -9)"
    finally:
        proc.kill()
        proc.wait()


def test_time_budget_is_honoured_while_waiting_for_admission(random_model_dir) -> None:
    """A trainer waiting for groups (say, all dropped as stale) still stops at the budget,
    and keeps the pending receive for the shutdown (nothing it brings is lost)."""
    from llm_trainer import built_trainer

    async def main(t) -> float:
        start = time.monotonic()
        got = await asyncio.wait_for(t.collect(2, t.keep, deadline=time.time() + 0.3), 5.0)
        waited = time.monotonic() - start
        assert got is None and t.next_msg is not None
        t.port.send("late group")
        assert await t.next_msg == "late group"
        return waited

    with built_trainer(random_model_dir, LLMConfig()) as trainer:
        assert 0.25 < asyncio.run(main(trainer)) < 5.0  # a hang guard above the budget


def test_stop_must_be_an_asyncio_event() -> None:
    import threading

    from grpo_nb.llm.data import RingSpec
    from grpo_nb.llm.run import run_ring
    from grpo_nb.metrics import MetricsRecorder

    spec = RingSpec("http://s", "m", "/nowhere", [])
    with pytest.raises(TypeError, match="asyncio.Event"):
        asyncio.run(run_ring(LLMConfig(), spec, MetricsRecorder(None), stop=threading.Event()))


def test_the_four_actors_build_as_monarch_actors() -> None:
    pytest.importorskip("monarch.actor")
    from grpo_nb.actors import backend, class_for
    from grpo_nb.llm.actors import Generator, Reference, Scorer, Trainer

    api = backend("monarch")
    for cls, endpoints in [(Generator, {"start", "progress", "drain"}),
                           (Scorer, {"inlet", "start"}), (Reference, {"inlet", "start"}),
                           (Trainer, {"inlet", "start", "request_stop"})]:
        twin = class_for(cls, api)
        assert issubclass(twin, api.Actor) and issubclass(twin, cls)
        assert endpoints <= set(vars(twin))


# ── real runs ──

SMALL = {"steps": 4, "generators": 2, "prompts_per_step": 4, "group_size": 4,
         "max_inflight": 4, "eval_every": 2, "eval_size": 100, "checkpoint_every": 2,
         "time_budget_s": 120.0}


LOGPROB_ATOL = 1e-3  # fp32 on both sides: measured max |Δ| ≈ 1e-5 at T = 0.7 (see report)


@pytest.mark.vllm
@pytest.mark.slow
def test_sampler_and_trainer_logprobs_agree_at_temperature_0_7(vllm_server,
                                                               tiny_model_dir) -> None:
    """The server serves the model file's weights. The PPO ratio divides the trainer's log-prob
    at T by the sampler's: both must be post-temperature, or fresh samples have ratio ≠ 1."""
    from grpo_nb.grpo import sequence_logprobs
    from grpo_nb.serving.client import CompletionsClient

    model, tok = load_policy(tiny_model_dir)
    prompts = [tok.encode(f"{a}+{b}=", add_special_tokens=False)
               for a, b in [(12, 345), (7, 80), (409, 3), (55, 55)]]

    async def sample() -> list[tuple[list[int], list[int], list[float]]]:
        async with CompletionsClient.for_server(vllm_server) as client:
            outs = await asyncio.gather(*[client.generate(p, max_tokens=8, temperature=0.7, n=4,
                                                          seed=i)
                                          for i, p in enumerate(prompts)])
        return [(p, c.token_ids, c.logprobs) for p, cs in zip(prompts, outs, strict=True)
                for c in cs]

    diffs, raw = [], []
    for prompt, ids, sampler in asyncio.run(sample()):
        x = torch.tensor([prompt + ids])
        with torch.no_grad():
            at = {t: sequence_logprobs(model, x, torch.ones_like(x), t)[0, len(prompt) - 1:]
                  for t in (0.7, 1.0)}
        diffs.append(at[0.7] - torch.tensor(sampler))
        raw.append(at[1.0] - torch.tensor(sampler))
    d, r = torch.cat(diffs), torch.cat(raw)
    assert d.numel() >= 32
    assert d.abs().max() < LOGPROB_ATOL, f"max |Δ| = {d.abs().max():.2e}"
    assert abs(float(d.exp().mean()) - 1.0) < 0.02  # the ratio on a fresh batch
    assert r.abs().mean() > 10 * LOGPROB_ATOL  # T matters: the check can tell them apart


def _overlaps(rec, a: str, b: str) -> float:
    """Total seconds during which an ``a`` interval and a ``b`` interval overlap."""
    busy = rec.rows("busy")
    xs = [(r["start"], r["end"]) for r in busy if r["label"] == a]
    ys = [(r["start"], r["end"]) for r in busy if r["label"] == b]
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in xs for s2, e2 in ys)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)  # 164 s seen under make test: the default 300 s is too near
def test_async_and_sync_modes_run_verify_and_schedule_differently(
        ring_server, tiny_model_dir, tmp_path: Path, monkeypatch) -> None:
    from grpo_nb.llm.run import train
    from grpo_nb.metrics import load_metrics
    from grpo_nb.weight_sync import WeightSyncer

    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path))
    base = load_policy(tiny_model_dir)[0]
    results, moved = {}, {}
    for mode in ("async", "sync"):
        cfg = LLMConfig(mode=mode, **SMALL)
        results[mode] = asyncio.run(train(cfg, model_dir=tiny_model_dir, name=mode,
                                          server=ring_server, smoke=True, progress=False))
        with WeightSyncer(ring_server.url, base) as probe:  # served vs base model log-probs
            moved[mode] = probe.weight_gap()
    for mode, r in results.items():
        assert r.steps == 4 and r.weights_verified, (mode, r)
        assert moved[mode] > 1e-3, (mode, moved)  # the syncs pushed weights that changed
        # A step whose groups all have equal rewards has zero advantages, hence no gradient.
        norms = [row["grad_norm"] for row in load_metrics(tmp_path / mode).rows("step")]
        assert all(n >= 0 for n in norms) and any(n > 0 for n in norms), norms
        assert 0.0 <= r.accuracy_after <= 1.0 and r.sync_ms_mean > 0
        rec = load_metrics(tmp_path / mode)
        assert [row["step"] for row in rec.rows("step")] == [1, 2, 3, 4]
        for row in rec.rows("step"):  # the diagnostics: present, in range, consistent
            assert 0 < row["entropy"] <= math.log(base.config.vocab_size), row
            assert 0 <= row["truncated_frac"] <= 1 and row["response_len"] > 0, row
            assert row["zero_std_frac"] == row["zero_std_groups"] / SMALL["prompts_per_step"]
            if row["zero_std_frac"] == 1.0:  # no group with any signal: nothing to learn
                assert row["grad_norm"] == 0.0, row
        assert r.entropy_end == round(rec.rows("step")[-1]["entropy"], 4), r
        assert 0 <= r.truncated_frac_mean <= 1 and r.response_len_mean > 0, r
        assert max(s for row in rec.rows("step") for s in row["staleness"]) <= 2
        assert (tmp_path / mode / "checkpoint" / "model.safetensors").is_file()
    assert _overlaps(load_metrics(tmp_path / "sync"), "generate", "train") == 0.0
    assert _overlaps(load_metrics(tmp_path / "async"), "generate", "train") > 0.0
    assert results["sync"].staleness_mean == 0.0

    # resume: continue the async run to 6 steps from its checkpoint
    from grpo_nb.llm.run import train as train_again

    cfg = LLMConfig(mode="async", **{**SMALL, "steps": 6})
    r = asyncio.run(train_again(cfg, model_dir=tiny_model_dir, resume=tmp_path / "async",
                                server=ring_server, smoke=True, progress=False))
    steps = [row["step"] for row in load_metrics(tmp_path / "async").rows("step")]
    assert steps == [1, 2, 3, 4, 5, 6] and r.weights_verified
    state = json.loads((tmp_path / "async" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 6


@pytest.mark.vllm
@pytest.mark.slow
def test_stop_event_ends_the_run_early_on_verified_weights(ring_server, tiny_model_dir,
                                                          tmp_path, monkeypatch) -> None:
    """The notebook's Stop button: the trainer finishes its step, drains, syncs, checkpoints."""
    from grpo_nb.llm.run import train

    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path))

    async def main():
        stop = asyncio.Event()

        def on_event(kind: str, rec) -> None:
            if kind == "step":
                stop.set()

        return await train(LLMConfig(**{**SMALL, "steps": 50}), model_dir=tiny_model_dir,
                           name="stop", server=ring_server, on_event=on_event, stop=stop,
                           smoke=True, progress=False)

    r = asyncio.run(main())
    assert 1 <= r.steps <= 2 and r.weights_verified, r
    state = json.loads((tmp_path / "stop" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == r.steps


@pytest.mark.vllm
@pytest.mark.slow
def test_train_on_an_unpinned_plan_puts_back_the_torch_threads(ring_server, tiny_model_dir,
                                                               tmp_path, monkeypatch) -> None:
    """A notebook kernel keeps its torch threads (and generator) after ``train()``, and the
    logged plan states the threads the trainer ran with."""
    from grpo_nb.llm.run import train
    from grpo_nb.metrics import load_metrics

    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path))
    monkeypatch.setattr(ring_server, "cpus", None)  # the plan: off, nothing pinned
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # not the trainer's (trainer_threads=1)
    rng = torch.random.get_rng_state()
    try:
        cfg = LLMConfig(**{**SMALL, "steps": 1, "eval_every": 1}, trainer_threads=1)
        r = asyncio.run(train(cfg, model_dir=tiny_model_dir, name="threads", server=ring_server,
                              smoke=True, progress=False))
        assert r.steps == 1 and torch.get_num_threads() == 3
        assert torch.equal(torch.random.get_rng_state(), rng)
    finally:
        torch.set_num_threads(before)
    (plan,) = load_metrics(tmp_path / "threads").rows("partition")
    assert not plan["active"] and plan["plan"].endswith("trainer with 1 torch thread(s)"), plan
