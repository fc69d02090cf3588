"""The GRPO objective as pure torch functions, shared by the toy ring (``T = 1``) and the LLM
trainer: ``B`` samples (groups are consecutive blocks of ``group_size``), ``T`` tokens each,
``V`` vocabulary; a masked-out position never reaches a loss, gradient or metric; float32.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

AdvScale = Literal["std", "none"]
KLKind = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ADV_SCALES, KL_KINDS, LOSS_AGGS = get_args(AdvScale), get_args(KLKind), get_args(LossAgg)


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (got {group_size}): GRPO compares samples "
                         "of the same prompt with each other")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"batch of {rewards.numel()} rewards is not a whole number of groups "
                         f"of group_size={group_size}")
    return rewards.detach().float().view(-1, group_size)


def zero_std_groups(rewards: Tensor, group_size: int) -> int:
    """Number of groups whose rewards are all equal; they carry no learning signal."""
    g = _groups(rewards, group_size)
    return int((g.amax(dim=1) == g.amin(dim=1)).sum().item())


def zero_std_fraction(rewards: Tensor, group_size: int) -> float:
    """:func:`zero_std_groups` as a fraction of the batch's groups (0 for an empty batch)."""
    flat = zero_std_groups(rewards, group_size)  # validates the shapes first
    return flat / (rewards.numel() // group_size) if rewards.numel() else 0.0


def group_advantages(
    rewards: Tensor, group_size: int, *, scale: AdvScale = "std", eps: float = 1e-6
) -> Tensor:
    """Detached float32 ``[B]``; ``A_i = (r_i - mean_g) / (std_g + eps)`` with ``scale="std"``
    (GRPO; unbiased std, as TRL), ``r_i - mean_g`` with ``"none"`` (Dr. GRPO); a flat group gets 0."""
    if scale not in ADV_SCALES:
        raise ValueError(f"scale must be one of {ADV_SCALES}, got {scale!r}")
    g = _groups(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale == "std":
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    flat = (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)).expand_as(g)
    return torch.where(flat, torch.zeros_like(centred), centred).reshape(-1)


def _chunk_logprobs(logits: Tensor, ids: Tensor, temperature: float) -> Tensor:
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    picked = x.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


def token_logprobs(
    logits: Tensor, token_ids: Tensor, temperature: float = 1.0, *, chunk_size: int = 1024
) -> Tensor:
    """float32 ``[B, T]`` log-probs of ``token_ids`` under ``softmax(logits / temperature)``
    (``logits [B, T, V]`` aligned with them); chunks are checkpointed so that only one chunk's
    float32 copy of the logits exists at once."""
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B,T,V] and token_ids [B,T], got "
                         f"{tuple(logits.shape)} and {tuple(token_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, v = logits.shape
    flat_logits = logits.reshape(b * t, v)
    flat_ids = token_ids.reshape(b * t).long()
    use_ckpt = torch.is_grad_enabled() and logits.requires_grad
    out = []
    for start in range(0, b * t, chunk_size):
        rows, ids = flat_logits[start:start + chunk_size], flat_ids[start:start + chunk_size]
        if use_ckpt:
            out.append(checkpoint(_chunk_logprobs, rows, ids, temperature, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(rows, ids, temperature))
    if not out:
        return logits.new_zeros((b, t), dtype=torch.float32)
    return torch.cat(out).view(b, t)


def next_token_logits(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``[B, L-1, V]``: a causal LM's logits at each position, which predict the next token."""
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]


def sequence_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor,
                      temperature: float) -> Tensor:
    """``[B, L-1]`` log-prob of each next token of ``input_ids`` under ``model`` (with grad)."""
    return token_logprobs(next_token_logits(model, input_ids, attention_mask),
                          input_ids[:, 1:], temperature)


def masked_entropy(logits: Tensor, mask: Tensor, temperature: float = 1.0, *,
                   chunk_size: int = 512) -> float:
    """Token-mean entropy (nats) of ``softmax(logits / temperature)`` where ``mask`` is set."""
    if logits.dim() != 3 or mask.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B,T,V] and mask [B,T], got {tuple(logits.shape)} "
                         f"and {tuple(mask.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    with torch.no_grad():
        rows, cols = (mask != 0).nonzero(as_tuple=True)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for s in range(0, rows.numel(), chunk_size):
            z = logits[rows[s:s + chunk_size], cols[s:s + chunk_size]].float() / temperature
            total += torch.special.entr(torch.softmax(z, dim=-1)).sum()
        return float(total) / max(rows.numel(), 1)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimates of ``KL(π_θ || π_ref)`` (Schulman), ``log κ = log π_ref - log π_θ``:
    ``k1 = -log κ``, ``k2 = ½ (log κ)²``, ``k3 = κ - 1 - log κ`` (GRPO)."""
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs "
                         f"{tuple(ref_logprobs.shape)} differ in shape")
    log_kappa = ref_logprobs.detach().float() - logprobs.float()
    if kind == "k1":
        return -log_kappa
    if kind == "k2":
        return 0.5 * log_kappa.square()
    return torch.expm1(log_kappa) - log_kappa


def aggregate(
    per_token: Tensor, mask: Tensor, loss_agg: LossAgg = "token-mean", max_tokens: int | None = None
) -> Tensor:
    """A per-token ``x [B, T]`` reduced over unmasked positions (``L_b``: row ``b``'s length)::

        token-mean:               Σ_b Σ_t m x / Σ_b L_b
        seq-mean-token-mean:      mean over {b : L_b > 0} of (Σ_t m x / L_b)
        seq-mean-token-sum-norm:  Σ_b Σ_t m x / (B · max_tokens)     (Dr. GRPO: the sampler's max)
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if per_token.dim() != 2 or mask.shape != per_token.shape:
        raise ValueError(f"expected per_token and mask of the same shape [B,T], got "
                         f"{tuple(per_token.shape)} and {tuple(mask.shape)}")
    m = mask.float()
    # where() rather than x*m: a masked position holding inf/nan must not leak into the sum.
    x = torch.where(m != 0, per_token.float(), torch.zeros((), device=per_token.device)) * m
    if loss_agg == "token-mean":
        return x.sum() / m.sum().clamp(min=1.0)
    if loss_agg == "seq-mean-token-mean":
        lengths = m.sum(dim=1)
        seq = x.sum(dim=1) / lengths.clamp(min=1.0)
        present = (lengths > 0).float()
        return (seq * present).sum() / present.sum().clamp(min=1.0)
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(
            f"loss_agg='seq-mean-token-sum-norm' needs max_tokens > 0 (the fixed maximum "
            f"completion length, Dr. GRPO's constant), got max_tokens={max_tokens}")
    return x.sum() / (per_token.shape[0] * max_tokens)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: LossAgg = "token-mean",
    max_tokens: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    sampler_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO loss to minimise (gradients through ``logprobs`` only) and its metrics; per
    token, with ``r = exp(logp - old)`` and ``A`` the advantage (``[B]`` or ``[B, T]``)::

        surrogate = min(r · A, clip(r, 1 - clip_low, 1 + clip_high) · A)      PPO-clip
        surrogate = max(surrogate, dual_clip · A)    where A < 0              dual-clip (optional)
        ℓ         = -w · surrogate + kl_coef · KL_kind(logp, ref)
        loss      = aggregate(ℓ, mask, loss_agg, max_tokens)

    ``w = min(exp(old - sampler), tis_cap)`` (detached) with truncated importance sampling, else 1.
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B,T], got {tuple(shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs),
                    ("sampler_logprobs", sampler_logprobs)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected "
                         f"[B]={tuple(shape[:1])} or [B,T]={tuple(shape)}")
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
                         f"clip_high={clip_high}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
    if (sampler_logprobs is None) != (tis_cap is None):
        raise ValueError("truncated importance sampling needs both sampler_logprobs and tis_cap")
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (a cap on r for A < 0), got {dual_clip}")

    m = mask.float()
    valid = m != 0
    logp = logprobs.float()
    adv = advantages.detach().float()
    adv = adv.unsqueeze(1).expand(shape) if adv.dim() == 1 else adv
    # Zeroing the log-ratio at padding keeps exp() finite there (padding may hold any value).
    log_ratio = torch.where(valid, logp - old_logprobs.detach().float(), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    if dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)

    weight = torch.ones_like(ratio)
    if sampler_logprobs is not None and tis_cap is not None:
        tis_log = torch.where(valid, old_logprobs.float() - sampler_logprobs.float(),
                              torch.zeros_like(logp)).detach()
        weight = torch.exp(tis_log).clamp(max=tis_cap)
    pg_tok = -weight * surrogate

    if ref_logprobs is not None:
        ref = torch.where(valid, ref_logprobs.float(), logp.detach())
        kl_tok = kl_penalty(logp, ref, kl_kind)
    else:
        kl_tok = torch.zeros_like(logp)
    per_token = pg_tok + kl_coef * kl_tok if kl_coef != 0.0 else pg_tok
    loss = aggregate(per_token, m, loss_agg, max_tokens)

    with torch.no_grad():
        r = ratio.detach()
        one = torch.ones((), device=r.device)
        capped = weight >= tis_cap if tis_cap is not None else torch.zeros_like(valid)
        values = {
            "loss": loss.detach(),
            "pg_loss": aggregate(pg_tok.detach(), m, loss_agg, max_tokens),
            "kl": aggregate(kl_tok.detach(), m),
            "clip_frac_low": aggregate(((r < 1.0 - clip_low) & (adv < 0)).float(), m),
            "clip_frac_high": aggregate(((r > 1.0 + clip_high) & (adv > 0)).float(), m),
            "ratio_mean": aggregate(r, m),
            "ratio_max": torch.where(valid, r, -torch.inf).max() if r.numel() else one,
            "ratio_min": torch.where(valid, r, torch.inf).min() if r.numel() else one,
            "tis_weight_mean": aggregate(weight, m),
            "tis_frac_capped": aggregate(capped.float(), m),
            "dual_clip_frac": aggregate(((r > dual_clip) & (adv < 0)).float(), m)
            if dual_clip is not None else torch.zeros((), device=r.device),
        }
        # one device-to-host copy for all metrics, not one sync per value
        stacked = torch.stack([v.float().reshape(()) for v in values.values()]).tolist()
        metrics = dict(zip(values, stacked, strict=True))
        if math.isinf(metrics["ratio_max"]):  # no unmasked token at all
            metrics["ratio_max"] = metrics["ratio_min"] = 1.0
    return loss, metrics
