"""grpo_nb.objectives (re-exported by grpo_nb.grpo) in closed form, without TRL: each
``loss_type``'s per-token objective and aggregation, GSPO's per-sequence ratio, the off-policy
sequence mask, ``delta``; the settings refused, in ``policy_loss`` and in both configs; and the
trainers passing them on and reporting the new metrics."""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import replace

import pytest
import torch

from grpo_nb.grpo import LOSS_TYPE_AGG, LOSS_TYPES, aggregate, policy_loss
from grpo_nb.llm.config import LLMConfig
from grpo_nb.toy.task import ToyConfig


def _one_token(ratio: float, adv: float, **kw):
    """policy_loss on one token with the given ratio: (loss, d loss / d logp, metrics)."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1),
                                **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


# ── the per-token objectives ──

# (ratio, A) -> CISPO with cap 1.2: loss -min(r, 1.2)·A·log r, gradient -min(r, 1.2)·A (the
# weight is detached: the gradient never vanishes), counted as clipped where r > 1.2 and A > 0.
CISPO_CASES = [(1.5, 1.0, 1), (0.5, 1.0, 0), (1.5, -1.0, 0), (1.1, 2.0, 0), (3.0, 2.0, 1)]


@pytest.mark.parametrize(("ratio", "adv", "clipped"), CISPO_CASES)
def test_cispo_closed_form(ratio: float, adv: float, clipped: int) -> None:
    loss, grad, m = _one_token(ratio, adv, loss_type="cispo", clip_high=1.2)
    w = min(ratio, 1.2)
    assert loss == pytest.approx(-w * adv * math.log(ratio), rel=1e-6)
    assert grad == pytest.approx(-w * adv, rel=1e-6)
    assert m["cispo_clip_frac"] == clipped
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0


# (ratio, A, τ_pos, τ_neg) -> SAPO: loss -(4/τ)σ(τ(r-1))·A, gradient -4σ(1-σ)·r·A; τ = τ_pos
# for A > 0, τ_neg otherwise.
SAPO_CASES = [(1.0, 1.0, 1.0, 1.05), (2.0, 1.0, 1.0, 1.05), (2.0, -1.0, 1.0, 1.05),
              (0.5, -2.0, 0.5, 3.0), (1.5, 1.0, 4.0, 0.2)]


@pytest.mark.parametrize(("ratio", "adv", "pos", "neg"), SAPO_CASES)
def test_sapo_closed_form(ratio: float, adv: float, pos: float, neg: float) -> None:
    loss, grad, _ = _one_token(ratio, adv, loss_type="sapo", sapo_temperature_pos=pos,
                               sapo_temperature_neg=neg)
    tau = pos if adv > 0 else neg
    s = 1 / (1 + math.exp(-tau * (ratio - 1)))
    assert loss == pytest.approx(-4 / tau * s * adv, rel=1e-6)
    assert grad == pytest.approx(-4 * s * (1 - s) * ratio * adv, rel=1e-5)


def test_sapo_defaults_are_trls() -> None:
    # on-policy the gate is σ(0) = ½: the loss is -2A/τ with TRL's τ_pos = 1, τ_neg = 1.05
    assert _one_token(1.0, 1.0, loss_type="sapo")[0] == pytest.approx(-2.0)
    assert _one_token(1.0, -1.0, loss_type="sapo")[0] == pytest.approx(2 / 1.05)


# (ratio, A) -> (loss, gradient, counted in delta_clip_frac), clip 0.2, delta 3: the ratio of
# A < 0 tokens is capped at delta; everything else is plain PPO-clip.
DELTA_CASES = [(5.0, -1.0, 3.0, 0.0, 1), (5.0, -2.0, 6.0, 0.0, 1), (2.0, -1.0, 2.0, 2.0, 0),
               (0.5, -1.0, 0.8, 0.0, 0), (5.0, 1.0, -1.2, 0.0, 0), (1.1, 1.0, -1.1, -1.1, 0)]


@pytest.mark.parametrize(("ratio", "adv", "loss", "grad", "counted"), DELTA_CASES)
def test_delta_closed_form(ratio, adv, loss, grad, counted) -> None:
    got_loss, got_grad, m = _one_token(ratio, adv, delta=3.0)
    assert got_loss == pytest.approx(loss, rel=1e-6)
    assert got_grad == pytest.approx(grad, rel=1e-6, abs=1e-12)
    assert m["delta_clip_frac"] == counted and m["dual_clip_frac"] == 0


def test_delta_is_dual_clip_under_another_name() -> None:
    g = torch.Generator().manual_seed(0)
    logp, adv = -torch.rand(8, 5, generator=g), torch.randn(8, generator=g)
    old = logp + torch.randn(8, 5, generator=g)
    out = []
    for kw in ({"delta": 2.0}, {"dual_clip": 2.0}):
        lp = logp.clone().requires_grad_()
        loss, m = policy_loss(lp, old, adv, torch.ones(8, 5), **kw)
        loss.backward()
        out.append((loss.item(), lp.grad, m["delta_clip_frac"] + m["dual_clip_frac"]))
    assert out[0][0] == pytest.approx(out[1][0]) and out[0][2] == out[1][2] > 0
    torch.testing.assert_close(out[0][1], out[1][1])


def test_gspo_takes_one_ratio_per_sequence() -> None:
    """log-ratios 0 and 0.16 over a sequence of two: r = e^0.08 for both tokens, so both get the
    same gradient -r·A / L; per token they get -r_t·A / L. Sequence 2 (mean log-ratio 0.25 >
    log 1.2, A > 0) is clipped whole; its padding position does not enter its mean."""
    logp = torch.tensor([[0.0, 0.16], [0.25, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = policy_loss(logp, torch.zeros(2, 2), torch.tensor([1.0, 1.0]), mask,
                          loss_type="grpo", importance_sampling_level="sequence")
    loss.backward()
    r = math.exp(0.08)
    assert loss.item() == pytest.approx((-r - 1.2) / 2, rel=1e-6)
    assert logp.grad.tolist() == [[pytest.approx(-r / 4), pytest.approx(-r / 4)], [0.0, 0.0]]
    assert m["clip_frac_high"] == 0.5 and m["ratio_max"] == pytest.approx(math.exp(0.25))
    assert m["ratio_mean"] == pytest.approx((r + math.exp(0.25)) / 2)  # over sequences
    per_token = logp.detach().clone().requires_grad_()
    policy_loss(per_token, torch.zeros(2, 2), torch.tensor([1.0, 1.0]), mask,
                loss_type="grpo")[0].backward()
    assert per_token.grad[0].tolist() == [pytest.approx(-0.25),
                                          pytest.approx(-math.exp(0.16) / 4)]


def test_off_policy_mask_drops_drifted_negative_sequences() -> None:
    """Mean drift (q - logp) over each sequence's own tokens, threshold 0.3: row 0 (A < 0,
    drift 0.5) is dropped; row 1 (A < 0, drift 0.1; its padding's 9 left out) and row 2
    (A > 0, drift 0.5) stay. q is the sampler's log-probs when given, else the old policy's.
    The fraction counts sequences (1 of 3), not tokens (3 of 7)."""
    logp = torch.zeros(3, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    drift = torch.tensor([[0.4, 0.6, 0.5], [0.1, 0.1, 9.0], [0.5, 0.5, 0.0]])
    adv = torch.tensor([-1.0, -1.0, 1.0])

    def run(**kw):
        lp = logp.clone().requires_grad_()
        loss, m = policy_loss(lp, kw.pop("old"), adv, mask, loss_type="bnpo",
                              off_policy_mask_threshold=0.3, **kw)
        loss.backward()
        return loss, lp.grad, m

    loss, grad, m = run(old=drift)  # no sampler: the old policy's drift
    plain = policy_loss(logp, drift, adv, mask, loss_type="bnpo")[0]
    kept = torch.exp(-drift[1:, :2]) * adv[1:, None]  # r = exp(logp - old), inside the clip
    assert loss.item() == pytest.approx(-kept.sum().item() / 7, rel=1e-6) != plain.item()
    assert grad[0].tolist() == [0.0, 0.0, 0.0] and (grad[1:, :2] != 0).all()
    assert m["off_policy_masked_frac"] == pytest.approx(1 / 3)
    # with a sampler, its drift decides: here row 1's, not row 0's
    sampler = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    _, grad, m = run(old=torch.zeros(3, 3), sampler_logprobs=sampler, tis_cap=10.0)
    assert (grad[0] != 0).all() and grad[1].tolist() == [0.0, 0.0, 0.0]
    assert (grad[2, :2] != 0).all()
    assert m["off_policy_masked_frac"] == pytest.approx(1 / 3)


# ── the aggregation each loss_type fixes ──


def test_seq_mean_token_sum_closed_form() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # LUSPO: each sequence's sum, averaged over all B rows (the empty one counts, as in TRL)
    assert aggregate(x, mask, "seq-mean-token-sum").item() == pytest.approx(16 / 3)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_aggregates_as_trl(loss_type: str) -> None:
    """Rows of lengths 1 and 3 with per-token terms ℓ: the loss is the loss_type's reduction,
    and the loss_agg that names it is accepted alongside."""
    logp = torch.tensor([[0.1, 0.0, 0.0], [-0.1, 0.05, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask, loss_type=loss_type, max_tokens=4,
                          clip_high=1.2 if loss_type == "cispo" else 0.2)
    r = torch.exp(logp)
    if loss_type == "cispo":
        ell = -r.clamp(max=1.2) * adv[:, None] * logp
    elif loss_type == "sapo":
        tau = torch.tensor([[1.0], [1.05]])
        ell = -4 / tau * torch.sigmoid(tau * (r - 1)) * adv[:, None]
    else:
        ell = -r * adv[:, None]  # every ratio is inside the clip
    row0, row1 = ell[0, 0].item(), ell[1].sum().item()
    # TRL's reductions, by its loss_type: per-sequence token means; the batch's token mean;
    # Dr. GRPO's B · max_completion_length; LUSPO's per-sequence sums
    per_seq_mean, token_mean = (row0 + row1 / 3) / 2, (row0 + row1) / 4
    expected = {"grpo": per_seq_mean, "sapo": per_seq_mean, "bnpo": token_mean,
                "dapo": token_mean, "cispo": token_mean, "dr_grpo": (row0 + row1) / (2 * 4),
                "luspo": (row0 + row1) / 2}[loss_type]
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    same, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask, loss_type=loss_type, max_tokens=4,
                          clip_high=1.2 if loss_type == "cispo" else 0.2,
                          loss_agg=LOSS_TYPE_AGG[loss_type])  # the agreeing loss_agg is fine
    assert same.item() == loss.item()


def test_no_loss_type_is_ppo_clip_by_token_mean_as_before() -> None:
    g = torch.Generator().manual_seed(1)
    logp, adv = -torch.rand(4, 3, generator=g), torch.randn(4, generator=g)
    old, mask = logp + 0.3 * torch.randn(4, 3, generator=g), torch.ones(4, 3)
    default = policy_loss(logp, old, adv, mask)
    for kw in ({"loss_agg": "token-mean"}, {"loss_type": "dapo"}, {"loss_type": "bnpo"}):
        again = policy_loss(logp, old, adv, mask, **kw)
        assert again[0].item() == default[0].item() and again[1] == default[1]


# ── refused settings: policy_loss, LLMConfig, ToyConfig ──

REFUSED = [
    ({"loss_type": "ppo"}, ["loss_type"]),
    ({"importance_sampling_level": "seq"}, ["importance_sampling_level"]),
    ({"off_policy_mask_threshold": 0.0}, ["off_policy_mask_threshold"]),
    ({"off_policy_mask_threshold": math.nan}, ["off_policy_mask_threshold"]),
    ({"sapo_temperature_pos": 0.0}, ["sapo_temperature_pos"]),
    ({"sapo_temperature_neg": -1.0}, ["sapo_temperature_neg"]),
    ({"delta": 1.1}, ["delta", "clip_high"]),
    ({"loss_type": "grpo", "loss_agg": "token-mean"}, ["loss_agg", "loss_type"]),
    ({"loss_type": "luspo", "loss_agg": "seq-mean-token-mean"}, ["loss_agg", "loss_type"]),
    ({"delta": 4.0, "dual_clip": 3.0}, ["delta", "dual_clip"]),
    ({"loss_type": "cispo", "delta": 4.0}, ["delta", "loss_type"]),
    ({"loss_type": "sapo", "dual_clip": 3.0}, ["dual_clip", "loss_type"]),
    ({"loss_type": "cispo", "clip_high": 0.0}, ["clip_high", "loss_type"]),
]


@pytest.mark.parametrize(("kw", "names"), REFUSED)
def test_policy_loss_refuses_naming_the_settings(kw: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), **kw)
    assert all(n in str(err.value) for n in names), err.value


@pytest.mark.parametrize(("kw", "names"), REFUSED)
def test_llm_config_refuses_naming_the_fields(kw: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        LLMConfig(**kw)
    assert all(f"LLMConfig.{n}" in str(err.value) for n in names), err.value


@pytest.mark.parametrize(("kw", "names"), [(k, n) for k, n in REFUSED
                                           if "loss_agg" not in k and "dual_clip" not in k])
def test_toy_config_refuses_naming_the_fields(kw: dict, names: list[str]) -> None:
    kw = {"clip" if k == "clip_high" else k: v for k, v in kw.items()}
    with pytest.raises(ValueError) as err:
        ToyConfig(**kw)
    names = ["clip" if n == "clip_high" else n for n in names]
    assert all(re.search(rf"ToyConfig\.{n}\b", str(err.value)) for n in names), err.value


def test_trls_advice_is_a_warning() -> None:
    with pytest.warns(UserWarning, match="importance_sampling_level='sequence'"):
        LLMConfig(loss_type="luspo")
    with pytest.warns(UserWarning, match="sums per-token terms"):
        LLMConfig(loss_type="dapo", importance_sampling_level="sequence")
    with pytest.warns(UserWarning, match="caps the weight r itself"):
        ToyConfig(loss_type="cispo")


def test_loss_type_sets_loss_agg_and_set_reads_the_fields() -> None:
    from grpo_nb.llm.cli import apply_sets

    base = LLMConfig().resolve()
    assert base.loss_agg == "token-mean" and "loss_agg" in base.defaults
    grpo = apply_sets(base, ["loss_type=grpo"])
    assert (grpo.loss_type, grpo.loss_agg) == ("grpo", "seq-mean-token-mean")
    assert apply_sets(grpo, ["loss_type=none"]).loss_agg == "token-mean"  # follows it back
    with pytest.warns(UserWarning):  # cispo with clip_high 0.2: TRL's default, scaled down
        cispo = apply_sets(base, ["loss_type=cispo"])
    assert (cispo.loss_type, cispo.loss_agg) == ("cispo", "token-mean")
    gspo = apply_sets(base, ["loss_type=grpo", "importance_sampling_level=sequence",
                             "off_policy_mask_threshold=0.5", "delta=4", "sapo_temperature_neg=2"])
    assert (gspo.importance_sampling_level, gspo.off_policy_mask_threshold, gspo.delta,
            gspo.sapo_temperature_neg) == ("sequence", 0.5, 4.0, 2.0)
    assert apply_sets(gspo, ["delta=none", "off_policy_mask_threshold=null"]).delta is None
    resumed = LLMConfig(**gspo.to_dict()).resolve()  # a run's config.json: values, as chosen
    assert resumed == gspo and "loss_agg" not in resumed.defaults
    with pytest.raises(ValueError, match="LLMConfig.loss_agg.*LLMConfig.loss_type"):
        LLMConfig(loss_agg="token-mean").replace(loss_type="grpo")  # a chosen value stays chosen


# ── the trainers pass the fields on and report the metrics ──


def _group(prompt: list[int], completions: list[list[int]], rewards: list[float]):
    from grpo_nb.grpo import group_advantages
    from grpo_nb.llm.data import Group, Rollout

    adv = group_advantages(torch.tensor(rewards), len(rewards)).tolist()
    rollouts = [Rollout(c, [-1.0] * len(c), "", "stop", r, a)
                for c, r, a in zip(completions, rewards, adv, strict=True)]
    return Group(0, "", "", prompt, rollouts, 0, 0.0, 0.0)


def test_toy_ring_runs_each_new_objective_and_reports_the_metrics() -> None:
    from grpo_nb.metrics import MetricsRecorder
    from grpo_nb.toy.run import run_ring

    for kw in ({"loss_type": "sapo", "off_policy_mask_threshold": 1e-6},
               {"loss_type": "luspo", "delta": 2.0, "importance_sampling_level": "sequence"},
               {"loss_type": "dr_grpo"}):
        cfg = replace(ToyConfig.smoke(), steps=6, gen_delay_s=0.0, generators=2, **kw)
        rec = MetricsRecorder(None)
        asyncio.run(asyncio.wait_for(run_ring(cfg, rec), 60))
        rows = rec.rows("step")
        assert len(rows) == 6
        for key in ("cispo_clip_frac", "delta_clip_frac", "off_policy_masked_frac"):
            assert all(math.isfinite(r[key]) for r in rows), key
        if "off_policy_mask_threshold" in kw:  # stale samples drift: some are dropped
            assert any(r["off_policy_masked_frac"] > 0 for r in rows)


def test_llm_trainer_passes_the_objective_on(random_model_dir, monkeypatch) -> None:
    from grpo_nb import grpo
    from grpo_nb.llm.policy import PolicyTrainer, load_policy

    seen: list[dict] = []
    real = grpo.policy_loss

    def spy(*args, **kw):
        seen.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    groups = [_group([3, 4, 5], [[6, 7, 1], [8, 9, 1]], [1.0, 0.0])]
    model, tok = load_policy(random_model_dir)
    cfg = LLMConfig(prompts_per_step=1, group_size=2, loss_type="cispo", clip_high=5.0,
                    importance_sampling_level="token", off_policy_mask_threshold=0.5,
                    sapo_temperature_pos=2.0)
    row = PolicyTrainer(model, tok, cfg).step(groups)
    assert {k: seen[0][k] for k in ("loss_type", "off_policy_mask_threshold", "loss_agg",
                                    "sapo_temperature_pos", "clip_high")} == {
        "loss_type": "cispo", "off_policy_mask_threshold": 0.5, "loss_agg": "token-mean",
        "sapo_temperature_pos": 2.0, "clip_high": 5.0}
    for key in ("cispo_clip_frac", "delta_clip_frac", "dual_clip_frac", "off_policy_masked_frac"):
        assert key in row and math.isfinite(row[key])


def test_llm_bnpo_averages_micro_batch_token_means(random_model_dir) -> None:
    """bnpo normalises by each micro-batch's own tokens (TRL's local batch), dapo by the whole
    batch's: with micro-batches of 6 and 2 tokens, bnpo's summed gradient is the mean of the
    two micro-batches' own, dapo's the batch's whatever grad_accum."""
    from grpo_nb.llm.policy import PolicyTrainer, load_policy

    groups = [_group([3, 4, 5], [[6, 7, 8, 1], [8, 1]], [1.0, 0.0]),
              _group([3, 4], [[6], [9]], [0.0, 1.0])]

    def grad(loss_type: str, parts: list, accum: int) -> torch.Tensor:
        model, tok = load_policy(random_model_dir)
        cfg = LLMConfig(prompts_per_step=len(parts), group_size=2, grad_accum=accum,
                        loss_type=loss_type, max_grad_norm=1e9)
        PolicyTrainer(model, tok, cfg).step(parts)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    alone = [grad("bnpo", [g], 1) for g in groups]
    torch.testing.assert_close(grad("bnpo", groups, 2), (alone[0] + alone[1]) / 2,
                               rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grad("dapo", groups, 2), grad("dapo", groups, 1),
                               rtol=1e-4, atol=1e-7)
    assert not torch.allclose(grad("dapo", groups, 2), grad("bnpo", groups, 2))
