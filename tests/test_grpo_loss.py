"""grpo_nb.grpo.policy_loss: closed-form values, clipping, masking, length bias, the sign."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_nb.grpo import group_advantages, policy_loss, token_logprobs


def _one_token(ratio: float, adv: float, **kw):
    """policy_loss on a single token with the given ratio; returns (loss, d loss / d logp, metrics)."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = policy_loss(
        logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), **kw
    )
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


# (ratio, advantage) -> (loss, gradient wrt logp, clipped low, clipped high), clip 0.2 / 0.2.
# The surrogate min(rA, clip(r)A) stops the gradient only when the clip makes it *smaller*.
CLIP_CASES = [
    (1.3, +1.0, -1.2, 0.0, 0, 1),  # A>0 above 1+ε: clipped, no gradient
    (1.1, +1.0, -1.1, -1.1, 0, 0),  # A>0 inside: -r, gradient -r
    (0.7, +1.0, -0.7, -0.7, 0, 0),  # A>0 below 1-ε: not clipped (pushes r back up)
    (0.7, -1.0, 0.8, 0.0, 1, 0),  # A<0 below 1-ε: clipped, no gradient
    (0.9, -1.0, 0.9, 0.9, 0, 0),  # A<0 inside
    (1.3, -1.0, 1.3, 1.3, 0, 0),  # A<0 above 1+ε: not clipped (pushes r back down)
    (1.3, +2.0, -2.4, 0.0, 0, 1),  # scaling by |A|
]


@pytest.mark.parametrize(("ratio", "adv", "loss", "grad", "low", "high"), CLIP_CASES)
def test_clip_boundaries(ratio, adv, loss, grad, low, high):
    got_loss, got_grad, m = _one_token(ratio, adv)
    assert got_loss == pytest.approx(loss, rel=1e-6)
    assert got_grad == pytest.approx(grad, rel=1e-6, abs=1e-12)
    assert (m["clip_frac_low"], m["clip_frac_high"]) == (low, high)
    assert m["ratio_mean"] == pytest.approx(ratio, rel=1e-6)


def test_clip_higher_is_asymmetric():
    # clip_high 0.28 lets r = 1.25 through for A > 0; clip_low 0.2 still clips r = 0.75 for A < 0.
    _, grad, m = _one_token(1.25, 1.0, clip_high=0.28)
    assert grad == pytest.approx(-1.25) and m["clip_frac_high"] == 0
    _, grad, _ = _one_token(1.25, 1.0)
    assert grad == 0.0
    loss, grad, m = _one_token(0.75, -1.0, clip_high=0.28)
    assert (loss, grad, m["clip_frac_low"]) == (pytest.approx(0.8), 0.0, 1.0)


# (ratio, advantage) -> (loss, gradient wrt logp, counted in dual_clip_frac), clip 0.2, dual 3.
DUAL_CASES = [
    (5.0, -1.0, 3.0, 0.0, 1),  # A<0 far above 1+ε: capped at 3·|A|, no gradient
    (5.0, -2.0, 6.0, 0.0, 1),  # the cap scales with |A|
    (2.0, -1.0, 2.0, 2.0, 0),  # A<0 between 1+ε and c: unclipped, as in plain PPO
    (0.5, -1.0, 0.8, 0.0, 0),  # A<0 below 1-ε: the ordinary lower clip
    (5.0, +1.0, -1.2, 0.0, 0),  # A>0: dual-clip never applies
]


@pytest.mark.parametrize(("ratio", "adv", "loss", "grad", "frac"), DUAL_CASES)
def test_dual_clip_against_hand_values(ratio, adv, loss, grad, frac):
    got_loss, got_grad, m = _one_token(ratio, adv, dual_clip=3.0)
    assert got_loss == pytest.approx(loss, rel=1e-6)
    assert got_grad == pytest.approx(grad, rel=1e-6, abs=1e-12)
    assert m["dual_clip_frac"] == frac


def test_negative_advantage_branch_is_unbounded_without_dual_clip():
    # PPO's clip does not bound a stale A < 0 token whose ratio grew: loss and gradient = r·|A|.
    for ratio in (2.0, 5.0, 20.0):
        loss, grad, m = _one_token(ratio, -1.0)
        assert loss == pytest.approx(ratio, rel=1e-6) and grad == pytest.approx(ratio, rel=1e-6)
        assert m["clip_frac_low"] == m["clip_frac_high"] == m["dual_clip_frac"] == 0
        capped, capped_grad, _ = _one_token(ratio, -1.0, dual_clip=3.0)
        assert capped == pytest.approx(min(ratio, 3.0), rel=1e-6)
        assert capped_grad == (pytest.approx(ratio, rel=1e-6) if ratio < 3 else 0.0)


def test_sum_norm_gradient_does_not_depend_on_micro_batching():
    """One batch, or two micro-batches each padded only to its own longest answer (what the LLM
    trainer does with grad_accum=2, weighting each micro-batch 1/2): the same gradient."""
    g = torch.Generator().manual_seed(6)
    lengths = torch.tensor([6, 2, 3, 1])
    mask = torch.arange(6)[None] < lengths[:, None]
    logp = torch.randn(4, 6, generator=g) * 0.1 - 1.0
    old = logp + 0.05 * torch.randn(4, 6, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])

    def grad(parts: list[slice]) -> torch.Tensor:
        x = logp.clone().requires_grad_()
        for rows in parts:
            width = int(lengths[rows].max())
            loss, _ = policy_loss(x[rows, :width], old[rows, :width], adv[rows],
                                  mask[rows, :width], loss_agg="seq-mean-token-sum-norm",
                                  max_tokens=8)
            (loss / len(parts)).backward()
        assert x.grad is not None
        return x.grad

    one = grad([slice(0, 4)])
    two = grad([slice(0, 2), slice(2, 4)])
    assert one.abs().sum() > 0
    torch.testing.assert_close(one, two)


def test_closed_form_aggregation_modes():
    # ratio 1 everywhere -> per-token loss is -A: [[-1, -1], [3, pad]]
    logp = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -3.0])
    expect = {
        "token-mean": 1 / 3,
        "seq-mean-token-mean": (-1 + 3) / 2,
        "seq-mean-token-sum-norm": 1 / 4,
    }
    for agg, value in expect.items():
        loss, m = policy_loss(logp, logp, adv, mask, loss_agg=agg, max_tokens=2)
        assert loss.item() == pytest.approx(value) and m["loss"] == pytest.approx(value)
    loss, _ = policy_loss(logp, logp, adv, mask, loss_agg="seq-mean-token-sum-norm", max_tokens=4)
    assert loss.item() == pytest.approx(1 / 8)


def test_length_bias_of_aggregation_modes():
    """Two wrong answers (A = -1), one 1 token long, one 4 tokens long: the weight each token gets."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([-1.0, -1.0])
    per_token_grad = {}
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        logp = torch.zeros(2, 4, requires_grad=True)
        policy_loss(logp, torch.zeros(2, 4), adv, mask, loss_agg=agg, max_tokens=4)[0].backward()
        per_token_grad[agg] = (logp.grad[0, 0].item(), logp.grad[1, 0].item())
    # token-mean: every token 1/5; seq-mean: short 1/2, long 1/8; sum-norm: all 1/(2*4)
    assert per_token_grad["token-mean"] == pytest.approx((1 / 5, 1 / 5))
    assert per_token_grad["seq-mean-token-mean"] == pytest.approx((1 / 2, 1 / 8))
    assert per_token_grad["seq-mean-token-sum-norm"] == pytest.approx((1 / 8, 1 / 8))


AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def test_padding_never_contributes():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g) * 0.1
    old = logp + 0.05 * torch.randn(3, 5, generator=g)
    ref = logp + 0.05 * torch.randn(3, 5, generator=g)
    lengths = [5, 2, 3]
    mask = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
    adv = torch.tensor([1.0, -0.5, 2.0])
    for agg in AGGS:
        loss, metrics = policy_loss(
            logp, old, adv, mask, loss_agg=agg, max_tokens=5, ref_logprobs=ref, kl_coef=0.1
        )
        # garbage at padded positions: a huge ratio, a NaN reference
        p = torch.where(mask, logp, 50.0).requires_grad_()
        loss2, m2 = policy_loss(
            p,
            torch.where(mask, old, -40.0),
            adv,
            mask,
            loss_agg=agg,
            max_tokens=5,
            ref_logprobs=torch.where(mask, ref, float("nan")),
            kl_coef=0.1,
        )
        assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
        assert m2 == pytest.approx(metrics, rel=1e-6)
        loss2.backward()
        assert torch.isfinite(p.grad).all() and (p.grad[~mask] == 0).all()
    # token-mean of the padded batch = token-weighted mean of each row's loss computed alone
    total = policy_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)[0].item()
    rows = [
        n
        * policy_loss(
            logp[i : i + 1, :n],
            old[i : i + 1, :n],
            adv[i : i + 1],
            mask[i : i + 1, :n],
            ref_logprobs=ref[i : i + 1, :n],
            kl_coef=0.1,
        )[0].item()
        for i, n in enumerate(lengths)
    ]
    assert total == pytest.approx(sum(rows) / sum(lengths), rel=1e-6)


def test_kl_term_closed_form():
    # ratio 1, A = 0: only the KL term. π_θ(y)=1/2, π_ref(y)=1/4 -> k3 = ln2 - 1/2, k1 = ln2.
    logp = torch.full((1, 2), math.log(0.5))
    ref = torch.full((1, 2), math.log(0.25))
    for kind, kl in (
        ("k3", math.log(2) - 0.5),
        ("k1", math.log(2)),
        ("k2", 0.5 * math.log(2) ** 2),
    ):
        loss, m = policy_loss(
            logp,
            logp,
            torch.zeros(1),
            torch.ones(1, 2),
            ref_logprobs=ref,
            kl_coef=0.25,
            kl_kind=kind,
        )
        assert loss.item() == pytest.approx(0.25 * kl) and m["kl"] == pytest.approx(kl)
    _, m = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2))
    assert m["kl"] == 0.0


def test_truncated_importance_sampling():
    # trainer's old logprob ln(1/2), sampler's ln(1/6): weight 3, capped at 2 for token 1.
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[1 / 6, 0.4]]))
    loss, m = policy_loss(
        logp, logp, torch.ones(1), torch.ones(1, 2), sampler_logprobs=sampler, tis_cap=2.0
    )
    assert loss.item() == pytest.approx(-(2.0 + 1.25) / 2)
    assert m["tis_weight_mean"] == pytest.approx(1.625) and m["tis_frac_capped"] == 0.5
    off, m_off = policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2))
    assert off.item() == pytest.approx(-1.0) and m_off["tis_weight_mean"] == 1.0


def test_t_equals_one_toy_shape():
    # the toy ring: one action per sample, T = 1
    logp = torch.log(torch.tensor([[0.2], [0.5], [0.3], [0.6]])).requires_grad_()
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
    losses = [
        policy_loss(logp, logp.detach(), adv, torch.ones(4, 1), loss_agg=a, max_tokens=1)[0]
        for a in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    ]
    assert losses[0].shape == () and all(x.item() == pytest.approx(0.0, abs=1e-7) for x in losses)
    losses[0].backward()
    torch.testing.assert_close(logp.grad[:, 0], -adv / 4)


def test_bf16_inputs_compute_in_fp32():
    g = torch.Generator().manual_seed(4)
    logp = torch.randn(4, 8, generator=g) * 0.3 - 2
    old = logp + 0.1 * torch.randn(4, 8, generator=g)
    adv = torch.randn(4, generator=g)
    mask = torch.ones(4, 8)
    loss16, _ = policy_loss(logp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    loss32, _ = policy_loss(
        logp.bfloat16().float(), old.bfloat16().float(), adv.bfloat16().float(), mask
    )
    assert loss16.dtype == torch.float32
    assert loss16.item() == loss32.item()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(kl_coef=0.1), "ref_logprobs"),
        (dict(tis_cap=2.0), "both"),
        (dict(clip_low=1.0), "clip_low"),
        (dict(loss_agg="sum"), "loss_agg"),
        (dict(loss_agg="seq-mean-token-sum-norm"), "max_tokens"),
        (dict(dual_clip=1.0), "dual_clip"),
    ],
)
def test_policy_loss_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), **kw)


def test_policy_loss_shape_errors():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 2))


# ── the sign ───────────────────────────────────────────────────────────────────────────────


def _bigram_step(loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """One SGD step on a bigram LM; returns the change in each sequence's total log-prob."""
    torch.manual_seed(0)
    vocab = 12
    model = torch.nn.Embedding(vocab, vocab)  # logits of the next token given the previous one
    # four sequences with disjoint contexts, so their log-probs move independently
    seqs = torch.arange(vocab).view(4, 3)
    inputs, targets = seqs[:, :-1], seqs[:, 1:]
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)  # + - - +
    mask = torch.ones_like(targets, dtype=torch.bool)

    def seq_logprob() -> torch.Tensor:
        return token_logprobs(model(inputs), targets)

    before = seq_logprob()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = loss_fn(seq_logprob(), before.detach(), adv, mask)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        return (seq_logprob() - before).sum(dim=1), adv


def test_one_step_raises_positive_and_lowers_negative_advantage_sequences():
    delta, adv = _bigram_step(lambda lp, old, a, m: policy_loss(lp, old, a, m)[0])
    assert (delta[adv > 0] > 0).all() and (delta[adv < 0] < 0).all()


def test_seed_sign_error_does_the_opposite():
    # seed 002 minimised mean(ratio * advantage): the wrong direction
    def seed_loss(lp, old, a, m):
        return (torch.exp(lp - old) * a[:, None] * m).sum(-1).div(m.sum(-1)).mean()

    delta, adv = _bigram_step(seed_loss)
    assert (delta[adv > 0] < 0).all() and (delta[adv < 0] > 0).all()


def test_per_token_advantages_and_empty_mask():
    g = torch.Generator().manual_seed(5)
    logp, old = torch.randn(3, 4, generator=g) * 0.2, torch.randn(3, 4, generator=g) * 0.2
    adv, mask = torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 4)
    broadcast, _ = policy_loss(logp, old, adv[:, None].expand(3, 4), mask)
    assert broadcast.item() == pytest.approx(policy_loss(logp, old, adv, mask)[0].item())
    empty, m = policy_loss(logp, old, adv, torch.zeros(3, 4))
    assert empty.item() == 0.0 and m["ratio_max"] == 1.0 and m["clip_frac_low"] == 0.0
