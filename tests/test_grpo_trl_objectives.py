"""grpo_nb.grpo.policy_loss against TRL 1.16's own ``GRPOTrainer._compute_loss``, objective by
objective: every ``loss_type`` at both importance-sampling levels (``grpo`` + ``sequence`` is
GSPO), the off-policy sequence mask (from the sampler's log-probs, and from the old policy's
when there is no sampler), ``delta`` (INTELLECT-2's two-sided clip) and SAPO's temperatures.
Value, gradient and the metrics TRL logs, on the same tensors, through a stub trainer.
"""

from __future__ import annotations

import pytest
import torch
from trl_stub import trl_loss

from grpo_nb.grpo import LOSS_TYPES, group_advantages, policy_loss

pytest.importorskip("trl")

PPO_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
EPS_LOW, BETA = 0.2, 0.04
# TRL's epsilon_high: the PPO clip's upper ε; under cispo the cap on the weight itself.
EPS_HIGH = {"cispo": 1.1}
DEFAULT_EPS_HIGH = 0.28


def _batch(seed: int, level: str, b: int = 12, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    # a sequence's ratio averages its tokens' log-ratios: spread those wider so that sequence
    # ratios still fall beyond both clip edges
    spread = 0.3 if level == "token" else 0.8
    old = logp + spread * torch.randn(b, t, generator=g)
    ref = logp + 0.2 * torch.randn(b, t, generator=g)
    sampler = old + 0.5 * torch.randn(b, t, generator=g)
    # every row keeps >= 1 token: TRL's "grpo" counts an empty row in its mean, we leave it out
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    rewards = torch.randint(0, 3, (b,), generator=g).float()
    return logp, old, ref, sampler, mask, group_advantages(rewards, 3, eps=1e-4)


def _compare(seed: int, loss_type: str, level: str = "token", *, opm: float | None = None,
             delta: float | None = None, sapo=(1.0, 1.05), tis: bool = False):
    """Ours and TRL's loss, gradient and metrics on one batch; returns our metrics."""
    logp, old, ref, sampler, mask, adv = _batch(seed, level)
    cap = 1.5
    is_ratio = torch.exp(old - sampler).clamp(max=cap) if tis else None
    ours_lp = logp.clone().requires_grad_()
    ours, metrics = policy_loss(
        ours_lp, old, adv, mask, loss_type=loss_type, clip_low=EPS_LOW,
        clip_high=EPS_HIGH.get(loss_type, DEFAULT_EPS_HIGH), max_tokens=logp.shape[1],
        ref_logprobs=ref, kl_coef=BETA, importance_sampling_level=level,
        off_policy_mask_threshold=opm, delta=delta, sapo_temperature_pos=sapo[0],
        sapo_temperature_neg=sapo[1], **({"sampler_logprobs": sampler, "tis_cap": cap}
                                         if tis else {}))
    ours.backward()
    trl_lp = logp.clone().requires_grad_()
    theirs, trl_metrics = trl_loss(trl_lp, old, ref, mask, adv, loss_type=loss_type,
                                   eps_low=EPS_LOW,
                                   eps_high=EPS_HIGH.get(loss_type, DEFAULT_EPS_HIGH), beta=BETA,
                                   level=level, opm=opm, delta=delta, sapo=sapo,
                                   sampler=sampler if tis else None, is_ratio=is_ratio)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(ours_lp.grad, trl_lp.grad, rtol=1e-5, atol=1e-7)
    assert ours_lp.grad.abs().sum() > 0
    assert metrics["kl"] == pytest.approx(trl_metrics["kl"][0], rel=1e-5)
    if loss_type in PPO_TYPES:
        assert metrics["clip_frac_low"] == pytest.approx(trl_metrics["clip_ratio/low_mean"][0])
        assert metrics["clip_frac_high"] == pytest.approx(trl_metrics["clip_ratio/high_mean"][0])
        assert 0 < metrics["clip_frac_low"] + metrics["clip_frac_high"] < 1  # both regimes
    else:
        assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0  # no PPO clip
    if loss_type == "cispo":
        assert metrics["cispo_clip_frac"] == pytest.approx(trl_metrics["cispo_clip_ratio"][0])
        assert 0 < metrics["cispo_clip_frac"] < 1
    if opm is not None:
        from trl.trainer.grpo_trainer import GRPOTrainer

        keep = GRPOTrainer.get_off_policy_mask(adv[:, None], logp, sampler if tis else old, mask,
                                               opm)
        assert metrics["off_policy_masked_frac"] == pytest.approx(1 - keep.mean().item())
        assert 0 < metrics["off_policy_masked_frac"] < 1
    else:
        assert metrics["off_policy_masked_frac"] == 0.0
    return metrics


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_matches_trl(loss_type: str, level: str) -> None:
    _compare(10, loss_type, level)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_truncated_importance_sampling_matches_trl(loss_type: str) -> None:
    _compare(11, loss_type, tis=True)


@pytest.mark.parametrize(("loss_type", "level", "tis"), [
    *[(lt, "token", True) for lt in LOSS_TYPES],  # the sampler's log-probs measure the drift
    ("grpo", "token", False), ("cispo", "token", False),  # without one, the old policy's
    ("grpo", "sequence", True),
])
def test_off_policy_mask_matches_trl(loss_type: str, level: str, tis: bool) -> None:
    _compare(17, loss_type, level, opm=0.15, tis=tis)


@pytest.mark.parametrize(("loss_type", "level"),
                         [*[(lt, "token") for lt in PPO_TYPES], ("grpo", "sequence")])
def test_delta_matches_trl(loss_type: str, level: str) -> None:
    metrics = _compare(13, loss_type, level, delta=1.5)
    assert metrics["delta_clip_frac"] > 0  # the cap bound some tokens


def test_sapo_temperatures_match_trl() -> None:
    _compare(14, "sapo", sapo=(0.5, 3.0))
    _compare(14, "sapo", "sequence", sapo=(2.0, 0.7))
