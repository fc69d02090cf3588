"""grpo_nb.grpo: advantages, log-probs, KL estimators, aggregation — against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_nb.grpo import (
    aggregate,
    group_advantages,
    kl_penalty,
    masked_entropy,
    token_logprobs,
    zero_std_fraction,
    zero_std_groups,
)

# ── group_advantages ───────────────────────────────────────────────────────────────────────


def test_group_advantages_std_closed_form():
    # group 1: [1,0,0,1] mean .5, unbiased std sqrt(1/3) -> ±0.5*sqrt(3) = ±0.8660254
    # group 2: [2,2,2,6] mean 3, unbiased std sqrt((1+1+1+9)/3) = 2 -> -0.5 ×3, 1.5
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 6.0])
    adv = group_advantages(rewards, 4, eps=0.0)
    s3 = math.sqrt(3) / 2
    expected = torch.tensor([s3, -s3, -s3, s3, -0.5, -0.5, -0.5, 1.5])
    torch.testing.assert_close(adv, expected)
    assert adv.dtype == torch.float32


def test_group_advantages_eps_and_none_scale():
    rewards = torch.tensor([3.0, 1.0])  # mean 2, unbiased std sqrt(2)
    torch.testing.assert_close(
        group_advantages(rewards, 2, eps=0.1), torch.tensor([1 / 1.5142135, -1 / 1.5142135])
    )
    torch.testing.assert_close(
        group_advantages(rewards, 2, scale="none"), torch.tensor([1.0, -1.0])
    )


@pytest.mark.parametrize("k", range(1, 8))
def test_std_scaling_fixes_the_sum_of_squares_not_of_magnitudes(k):
    # What dividing by the unbiased std equalises across difficulties is Σ A² = G - 1; Σ |A|
    # still depends on the success rate (a 1-in-8 group has less total |A| than a 4-in-8 one).
    g = 8
    r = torch.tensor([1.0] * k + [0.0] * (g - k))
    a = group_advantages(r, g, eps=0.0)
    assert a.square().sum().item() == pytest.approx(g - 1, rel=1e-5)
    n = group_advantages(r, g, scale="none")
    assert n.square().sum().item() == pytest.approx(k * (g - k) / g, rel=1e-5)
    balanced = group_advantages(torch.tensor([1.0] * 4 + [0.0] * 4), g, eps=0.0)
    if k != 4:
        assert a.abs().sum() < balanced.abs().sum()


def test_std_scaling_difficulty_bias():
    # A nearly-solved group [1,1,1,0]: without std scaling the single failure gets -0.75, with it
    # -1.5; a 50/50 group [1,1,0,0] gets ±0.5 unscaled and ±0.866 scaled. Std scaling inflates the
    # nearly-solved group relative to the balanced one (ratio 0.75/0.5 -> 1.5/0.866).
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    none = group_advantages(rewards, 4, scale="none")
    std = group_advantages(rewards, 4, eps=0.0)
    torch.testing.assert_close(none, torch.tensor([0.25, 0.25, 0.25, -0.75, 0.5, 0.5, -0.5, -0.5]))
    torch.testing.assert_close(std[3], torch.tensor(-1.5))
    assert (std[3] / std[4]).abs().item() == pytest.approx(1.5 / (math.sqrt(3) / 2), rel=1e-5)


def test_zero_std_groups_get_exact_zero():
    # In float32 mean([0.9, 0.9, 0.9]) != 0.9: a naive (r - mean) / (std + eps) turns that
    # rounding error into advantages of ±0.06.
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.7, 0.7, 0.7, 0.0, 1.0, 0.5])
    naive = rewards[:3] - rewards[:3].mean()
    assert naive.abs().max() > 0  # the float32 trap this guards against is real
    adv = group_advantages(rewards, 3)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert adv[6:].abs().sum() > 0
    assert zero_std_groups(rewards, 3) == 2
    assert zero_std_groups(torch.tensor([0.0, 1.0, 1.0, 1.0]), 2) == 1
    assert torch.equal(group_advantages(rewards, 3, scale="none")[:6], torch.zeros(6))
    assert zero_std_fraction(rewards, 3) == pytest.approx(2 / 3)
    assert zero_std_fraction(torch.tensor([0.0, 1.0, 1.0, 1.0]), 2) == 0.5
    assert zero_std_fraction(torch.zeros(0), 2) == 0.0


def test_group_advantages_bf16_and_detached():
    rewards = torch.tensor([1.0, 0.0], dtype=torch.bfloat16, requires_grad=True)
    adv = group_advantages(rewards, 2)
    assert adv.dtype == torch.float32 and not adv.requires_grad


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        (torch.zeros(5), 2, "whole number of groups"),
        (torch.zeros(4), 1, "group_size must be >= 2"),
        (torch.zeros(2, 2), 2, "1-D"),
    ],
)
def test_group_advantages_errors(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)
    with pytest.raises(ValueError, match=match):
        zero_std_groups(rewards, group_size)
    with pytest.raises(ValueError, match=match):
        zero_std_fraction(rewards, group_size)


# ── token_logprobs ─────────────────────────────────────────────────────────────────────────


def test_token_logprobs_closed_form_and_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # probs [1/4, 3/4]
    ids = torch.tensor([[1, 0]])
    torch.testing.assert_close(
        token_logprobs(logits, ids), torch.tensor([[math.log(0.75), math.log(0.25)]])
    )
    # τ = 2: softmax([0, ln3 / 2]) = [1, √3] / (1 + √3)
    torch.testing.assert_close(
        token_logprobs(logits, ids, temperature=2.0),
        torch.tensor([[math.log(math.sqrt(3) / (1 + math.sqrt(3))), -math.log(1 + math.sqrt(3))]]),
    )


def test_token_logprobs_gradient_is_onehot_minus_softmax():
    logits = torch.tensor([[[0.0, math.log(3.0)]]], requires_grad=True)
    token_logprobs(logits, torch.tensor([[1]]), chunk_size=1).sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.25, 0.25]]]))


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 1000])
def test_token_logprobs_chunking_matches_unchunked(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (3, 4), generator=g)
    out = token_logprobs(logits, ids, chunk_size=chunk_size)
    ref = torch.log_softmax(logits.detach(), -1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(out, ref)
    (out * torch.arange(12.0).view(3, 4)).sum().backward()
    chunked_grad = logits.grad.clone()
    logits.grad = None
    (token_logprobs(logits, ids, chunk_size=12) * torch.arange(12.0).view(3, 4)).sum().backward()
    torch.testing.assert_close(chunked_grad, logits.grad)


def test_token_logprobs_bf16_and_large_vocab():
    # Qwen's 151,936-token vocabulary, bf16 logits: fp32 result, chunked rows.
    g = torch.Generator().manual_seed(1)
    v = 151_936
    logits = (torch.randn(2, 3, v, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, v, (2, 3), generator=g)
    out = token_logprobs(logits, ids, chunk_size=2)
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(out, ref)


def test_token_logprobs_keeps_no_float32_copy_for_backward():
    # Autograd must not hold a float32 [rows, V] copy per chunk until backward: checkpointed
    # chunks save only their (bf16) inputs, which are views of the logits that exist anyway.
    logits = torch.randn(2, 8, 5000, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 5000, (2, 8))
    saved_bytes = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved_bytes
        saved_bytes += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = token_logprobs(logits, ids, chunk_size=4)
    logits_bytes = logits.numel() * logits.element_size()
    assert saved_bytes < 1.1 * logits_bytes  # a float32 copy alone would be 2x
    out.sum().backward()
    x = logits.detach().float().requires_grad_()
    torch.log_softmax(x, -1).gather(-1, ids[..., None]).sum().backward()
    torch.testing.assert_close(logits.grad.float(), x.grad, atol=1e-2, rtol=0)


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), 0.0)


# ── kl_penalty ─────────────────────────────────────────────────────────────────────────────

LN2 = math.log(2.0)


@pytest.mark.parametrize(
    ("kind", "value", "grad"),
    [
        # π_θ(y) = 1/2, π_ref(y) = 1/4: log ρ = -ln 2, ρ = 1/2
        ("k1", LN2, 1.0),
        ("k2", 0.5 * LN2**2, LN2),
        ("k3", 0.5 - 1.0 + LN2, 0.5),
    ],
)
def test_kl_estimators_closed_form_value_and_gradient(kind, value, grad):
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], requires_grad=True)
    k = kl_penalty(logp, ref, kind)
    assert k.item() == pytest.approx(value, rel=1e-6)
    k.sum().backward()
    assert logp.grad.item() == pytest.approx(grad, rel=1e-6)
    assert ref.grad is None  # the reference is a constant


def _true_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum()


def test_kl_estimators_expected_gradients():
    """E_{y~π}[∇ k(y)] with exact weights: k1 → 0, k2 → ∇KL(π||ref), k3 → ∇KL(ref||π)."""
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(6, generator=g, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, generator=g), -1)
    targets = {}
    for name, kl in (("k2", lambda lp: _true_kl(lp, ref)), ("k3", lambda lp: _true_kl(ref, lp))):
        (targets[name],) = torch.autograd.grad(kl(torch.log_softmax(theta, -1)), theta)
    targets["k1"] = torch.zeros(6)
    for kind, target in targets.items():
        logp = torch.log_softmax(theta, -1)
        expected = (logp.exp().detach() * kl_penalty(logp[None], ref[None], kind)[0]).sum()
        (grad,) = torch.autograd.grad(expected, theta)
        torch.testing.assert_close(grad, target, atol=1e-6, rtol=1e-5)
    assert targets["k2"].abs().sum() > 1e-3 and targets["k3"].abs().sum() > 1e-3


def test_kl_estimators_bias_on_samples():
    """k1 and k3 are unbiased estimators of KL(π||ref); k3 is never negative, k1 can be."""
    g = torch.Generator().manual_seed(3)
    logits_p = torch.randn(8, generator=g)
    p, ref = (
        torch.log_softmax(logits_p, -1),
        torch.log_softmax(logits_p + 0.5 * torch.randn(8, generator=g), -1),
    )
    true = _true_kl(p, ref).item()
    y = torch.multinomial(p.exp(), 200_000, replacement=True, generator=g)
    est = {k: kl_penalty(p[y][None], ref[y][None], k)[0] for k in ("k1", "k2", "k3")}
    se = {k: (e.std() / math.sqrt(e.numel())).item() for k, e in est.items()}
    assert abs(est["k1"].mean().item() - true) < 5 * se["k1"]
    assert abs(est["k3"].mean().item() - true) < 5 * se["k3"]
    assert (est["k3"] >= 0).all() and (est["k1"] < 0).any()
    assert est["k3"].var() < est["k1"].var()


def test_kl_penalty_errors():
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 1))


# ── aggregate ──────────────────────────────────────────────────────────────────────────────


def test_aggregate_closed_form():
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(16 / 4)
    # sequences with tokens: (1+2+3)/3 = 2 and 10/1 = 10 -> 6; the empty row is left out
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx(6.0)
    assert aggregate(x, mask, "seq-mean-token-sum-norm", max_tokens=3).item() == pytest.approx(
        16 / (3 * 3)
    )
    assert aggregate(x, mask, "seq-mean-token-sum-norm", max_tokens=8).item() == pytest.approx(
        16 / 24
    )
    with pytest.raises(ValueError, match="max_tokens"):  # no silent fallback to the padded width
        aggregate(x, mask, "seq-mean-token-sum-norm")
    assert aggregate(x, torch.zeros_like(mask), "token-mean").item() == 0.0


def test_aggregate_ignores_nonfinite_padding():
    x = torch.tensor([[1.0, float("nan")], [2.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        out = aggregate(x, mask, agg, max_tokens=2)
        assert torch.isfinite(out)
        (grad,) = torch.autograd.grad(out, x)
        assert torch.equal(grad[:, 1], torch.zeros(2))


def test_aggregate_errors():
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean")
    with pytest.raises(ValueError, match="same shape"):
        aggregate(torch.zeros(1, 2), torch.ones(1, 1))


# ── masked_entropy ─────────────────────────────────────────────────────────────────────────


def test_masked_entropy_closed_form_over_unmasked_positions_only():
    # Row 0: uniform over 4 → ln 4; [1/4, 3/4, 0, 0] (two -inf logits) → ln 4 - (3/4) ln 3;
    # one certain token → 0. Row 1 is padding holding garbage (nan, inf): masked, never read.
    third = [0.0, math.log(3.0), -math.inf, -math.inf]
    logits = torch.tensor([[[0.0] * 4, third, [0.0, 200.0, 0.0, 0.0]],
                           [[math.nan] * 4, [math.inf, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    h_third = math.log(4.0) - 0.75 * math.log(3.0)
    assert masked_entropy(logits, mask) == pytest.approx((math.log(4.0) + h_third) / 3, rel=1e-6)
    # one position at a time, any chunk size: the same values
    only = torch.tensor([[0, 1, 0], [0, 0, 0]])
    assert masked_entropy(logits, only, chunk_size=1) == pytest.approx(h_third, rel=1e-6)
    # temperature τ: the entropy of softmax(z / τ); τ → large flattens towards ln 4
    z = torch.tensor([[[0.0, math.log(3.0) * 2, -10.0, -10.0]]])
    assert masked_entropy(z, torch.ones(1, 1), temperature=2.0) == pytest.approx(
        masked_entropy(z / 2, torch.ones(1, 1)), rel=1e-6)
    assert masked_entropy(z, torch.ones(1, 1), temperature=1e4) == pytest.approx(math.log(4),
                                                                                   rel=1e-3)
    assert masked_entropy(logits, torch.zeros(2, 3)) == 0.0  # nothing unmasked


def test_masked_entropy_bf16_matches_float64_and_takes_no_gradient():
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 50, generator=gen)).requires_grad_()
    mask = torch.rand(3, 5, generator=gen) > 0.4
    p = torch.softmax(logits.detach().double(), -1)
    per_token = -(p * p.log()).sum(-1)
    expected = float(per_token[mask].mean())
    assert masked_entropy(logits, mask, chunk_size=4) == pytest.approx(expected, rel=1e-5)
    assert masked_entropy(logits.detach().bfloat16(), mask) == pytest.approx(expected, rel=2e-2)
    assert logits.grad is None and isinstance(masked_entropy(logits, mask), float)
    with pytest.raises(ValueError, match="mask"):
        masked_entropy(logits, mask[:, :4])
