"""grpo_nb.grpo against TRL's GRPO loss.

Two layers:

* ``test_matches_trl_documented_formulas`` always runs: it evaluates the formulas written in
  TRL's GRPOTrainer documentation (advantages, k3 KL, PPO-clip with ε_low / ε_high, and the
  ``grpo`` / ``bnpo`` / ``dr_grpo`` normalisations) with plain Python scalar loops, and compares
  them with our vectorised functions on random inputs.
* ``test_matches_trl_code`` runs only where ``trl`` is importable (it is not a dependency of this
  project; ``pip install trl`` adds it beside our torch / transformers without changing them). It
  calls TRL's own ``GRPOTrainer._compute_loss`` on the same tensors, with a stub trainer object.
"""

from __future__ import annotations

import math

import pytest
import torch
from trl_stub import trl_loss

from grpo_nb.grpo import group_advantages, policy_loss, token_logprobs

# TRL loss_type -> our loss_agg
TRL_AGG = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04


def _random_batch(seed: int, b: int = 6, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g)  # ratios spread across both clip edges
    ref = logp + 0.2 * torch.randn(b, t, generator=g)
    # every row keeps >= 1 token: TRL's "grpo" counts an empty row in its mean, we leave it out
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    rewards = torch.randint(0, 3, (b,), generator=g).float()
    return logp, old, ref, mask, rewards


def _documented_loss(logp, old, ref, mask, adv, loss_type: str, max_len: int) -> float:
    """TRL docs, written out token by token:
    L = -(1/N) Σ_i Σ_t [min(ρ A_i, clip(ρ, 1-ε_low, 1+ε_high) A_i) - β D_KL],
    ρ = π_θ/π_old, D_KL = π_ref/π_θ - log(π_ref/π_θ) - 1; N per loss_type."""
    rows = []
    for i in range(len(logp)):
        terms = []
        for t in range(len(logp[i])):
            if mask[i][t] == 0:
                continue
            rho = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(rho, 1 - EPS_LOW), 1 + EPS_HIGH)
            kl = math.exp(ref[i][t] - logp[i][t]) - (ref[i][t] - logp[i][t]) - 1
            terms.append(-(min(rho * adv[i], clipped * adv[i]) - BETA * kl))
        rows.append(terms)
    if loss_type == "grpo":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if loss_type == "bnpo":
        return sum(map(sum, rows)) / sum(map(len, rows))
    return sum(map(sum, rows)) / (len(rows) * max_len)


def _documented_advantages(rewards: list[float], g: int) -> list[float]:
    out = []
    for k in range(0, len(rewards), g):
        grp = rewards[k : k + g]
        mean = sum(grp) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (g - 1))
        out += [(r - mean) / (std + 1e-4) for r in grp]
    return out


def _our_loss(logp, old, ref, mask, adv, loss_type, **kwargs):
    """``grpo.policy_loss`` with the settings of the TRL loss it is compared with
    (``max_tokens``: TRL's max_completion_length)."""
    return policy_loss(logp, old, adv, mask, clip_low=EPS_LOW, clip_high=EPS_HIGH,
                       loss_agg=TRL_AGG[loss_type], max_tokens=logp.shape[1], ref_logprobs=ref,
                       kl_coef=BETA, kl_kind="k3", **kwargs)


@pytest.mark.parametrize("loss_type", list(TRL_AGG))
def test_matches_trl_documented_formulas(loss_type):
    logp, old, ref, mask, rewards = _random_batch(0)
    adv = group_advantages(rewards, 3, eps=1e-4)
    expected_adv = _documented_advantages(rewards.tolist(), 3)
    # TRL keeps the tiny (r - mean) / 1e-4 of a zero-std group; both are 0 for exactly equal rewards
    assert adv.tolist() == pytest.approx(expected_adv, abs=1e-5)
    loss, _ = _our_loss(logp, old, ref, mask, adv, loss_type)
    expected = _documented_loss(
        logp.tolist(),
        old.tolist(),
        ref.tolist(),
        mask.tolist(),
        adv.tolist(),
        loss_type,
        logp.shape[1],
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("loss_type", list(TRL_AGG))
@pytest.mark.parametrize("tis", [False, True])
def test_matches_trl_code(loss_type, tis):
    pytest.importorskip("trl")
    logp, old, ref, mask, rewards = _random_batch(1)
    adv = group_advantages(rewards, 2, eps=1e-4)
    sampler = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    cap = 1.5
    is_ratio = torch.exp(old - sampler).clamp(max=cap) if tis else None
    tis_kw = {"sampler_logprobs": sampler, "tis_cap": cap} if tis else {}

    ours_lp = logp.clone().requires_grad_()
    ours, metrics = _our_loss(ours_lp, old, ref, mask, adv, loss_type, **tis_kw)
    ours.backward()
    trl_lp = logp.clone().requires_grad_()
    theirs, trl_metrics = trl_loss(trl_lp, old, ref, mask, adv, loss_type=loss_type,
                                   eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=BETA,
                                   is_ratio=is_ratio)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    torch.testing.assert_close(ours_lp.grad, trl_lp.grad, rtol=1e-5, atol=1e-7)
    assert metrics["clip_frac_low"] == pytest.approx(trl_metrics["clip_ratio/low_mean"][0])
    assert metrics["clip_frac_high"] == pytest.approx(trl_metrics["clip_ratio/high_mean"][0])
    assert metrics["kl"] == pytest.approx(trl_metrics["kl"][0], rel=1e-5)
    assert 0 < metrics["clip_frac_low"] + metrics["clip_frac_high"] < 1  # both regimes exercised


def test_token_logprobs_matches_trl():
    pytest.importorskip("trl")
    from trl.trainer.utils import selective_log_softmax

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 40, generator=g)
    ids = torch.randint(0, 40, (3, 5), generator=g)
    torch.testing.assert_close(
        token_logprobs(logits, ids, chunk_size=4), selective_log_softmax(logits, ids)
    )
