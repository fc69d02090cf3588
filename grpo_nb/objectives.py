"""The policy objectives of :mod:`grpo_nb.grpo` (re-exported there): the KL estimators, the
aggregations and :func:`policy_loss`, which speaks TRL 1.16's ``GRPOConfig`` names (``loss_type``,
``importance_sampling_level``, ``off_policy_mask_threshold``, ``delta``, the SAPO temperatures)
with TRL's meanings and defaults. Shapes: ``B`` samples, ``T`` tokens each; float32; a masked-out
position never reaches a loss, gradient or metric.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal, get_args

import torch
from torch import Tensor

KLKind = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                  "seq-mean-token-sum"]
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"]
ISLevel = Literal["token", "sequence"]
KL_KINDS, LOSS_AGGS = get_args(KLKind), get_args(LossAgg)
LOSS_TYPES, IS_LEVELS = get_args(LossType), get_args(ISLevel)
# The aggregation each TRL loss_type fixes. bnpo (the micro-batch's tokens) and dapo / cispo
# (the accumulated batch's tokens) agree on one batch; the LLM trainer weighs micro-batches
# so that they differ as in TRL.
LOSS_TYPE_AGG: dict[str, LossAgg] = {
    "grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "bnpo": "token-mean",
    "dapo": "token-mean", "cispo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum"}
SAPO_TEMPERATURE_POS, SAPO_TEMPERATURE_NEG = 1.0, 1.05  # TRL's defaults
# The policy_loss arguments both configs declare under the same names (the trainers pass them on).
OBJECTIVE_FIELDS = ("loss_type", "importance_sampling_level", "off_policy_mask_threshold",
                    "delta", "sapo_temperature_pos", "sapo_temperature_neg")


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
        seq-mean-token-sum:       Σ_b Σ_t m x / B                    (LUSPO)
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
    if loss_agg == "seq-mean-token-sum":
        return x.sum() / max(per_token.shape[0], 1)
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(
            f"loss_agg='seq-mean-token-sum-norm' needs max_tokens > 0 (the fixed maximum "
            f"completion length, Dr. GRPO's constant), got max_tokens={max_tokens}")
    return x.sum() / (per_token.shape[0] * max_tokens)


def check_objective(
    *, loss_type: str | None = None, loss_agg: str | None = None,
    importance_sampling_level: str = "token", off_policy_mask_threshold: float | None = None,
    delta: float | None = None, dual_clip: float | None = None, clip_high: float = 0.2,
    sapo_temperature_pos: float = SAPO_TEMPERATURE_POS,
    sapo_temperature_neg: float = SAPO_TEMPERATURE_NEG,
    prefix: str = "", clip_high_name: str = "clip_high", warn: bool = True,
) -> LossAgg:
    """The aggregation :func:`policy_loss` uses for these settings (``loss_type``'s, else
    ``loss_agg``, else ``token-mean``), after refusing values and combinations it cannot honour;
    errors name the fields as ``{prefix}{name}``. With ``warn``, warns where TRL's GRPOTrainer
    warns (the configs do, once, at construction)."""
    p = prefix
    if loss_type is not None and loss_type not in LOSS_TYPES:
        raise ValueError(f"{p}loss_type={loss_type!r}: use one of {LOSS_TYPES}, or None "
                         "(PPO-clip aggregated by loss_agg)")
    if loss_agg is not None and loss_agg not in LOSS_AGGS:
        raise ValueError(f"{p}loss_agg={loss_agg!r}: use one of {LOSS_AGGS}")
    agg = LOSS_TYPE_AGG[loss_type] if loss_type is not None else loss_agg or "token-mean"
    if loss_agg is not None and loss_agg != agg:
        raise ValueError(f"{p}loss_agg={loss_agg!r} contradicts {p}loss_type={loss_type!r}, "
                         f"which aggregates by {agg!r}: drop loss_agg or set it to {agg!r}")
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(f"{p}importance_sampling_level={importance_sampling_level!r}: use one "
                         f"of {IS_LEVELS}")
    if off_policy_mask_threshold is not None and not (
            off_policy_mask_threshold > 0 and math.isfinite(off_policy_mask_threshold)):
        raise ValueError(f"{p}off_policy_mask_threshold={off_policy_mask_threshold}: must be a "
                         "finite number > 0 (the mean KL above which a negative-advantage "
                         "sequence is dropped), or None")
    for name, tau in (("sapo_temperature_pos", sapo_temperature_pos),
                      ("sapo_temperature_neg", sapo_temperature_neg)):
        if not (tau > 0 and math.isfinite(tau)):
            raise ValueError(f"{p}{name}={tau}: must be a finite number > 0")
    if delta is not None and dual_clip is not None:
        raise ValueError(f"{p}delta={delta} with {p}dual_clip={dual_clip}: both cap the ratio "
                         "of negative-advantage tokens (INTELLECT-2's and dual-clip PPO's "
                         "names); set one")
    for name, value in (("delta", delta), ("dual_clip", dual_clip)):
        if value is not None and loss_type in ("cispo", "sapo"):
            raise ValueError(f"{p}{name}={value} with {p}loss_type={loss_type!r} does nothing: "
                             f"it caps PPO-clip's ratio, and {loss_type} has no PPO clip")
    if delta is not None and not delta > 1.0 + clip_high:
        raise ValueError(f"{p}delta={delta}: must be > 1 + {p}{clip_high_name} = "
                         f"{1.0 + clip_high} (it caps ratios the clip left unbounded)")
    if loss_type == "cispo" and not clip_high > 0:
        raise ValueError(f"{p}{clip_high_name}={clip_high} with {p}loss_type='cispo': the cap "
                         "on CISPO's weight must be > 0")
    if not warn:
        return agg
    if loss_type == "cispo" and clip_high < 1.0:
        warnings.warn(f"{p}loss_type='cispo' caps the weight r itself at {p}{clip_high_name}="
                      f"{clip_high} (TRL's epsilon_high; ScaleRL uses 5.0): every update is "
                      "scaled down", stacklevel=1)
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        warnings.warn(f"{p}loss_type='luspo' is meant for {p}importance_sampling_level="
                      "'sequence' (the LUSPO paper's setup)", stacklevel=1)
    if importance_sampling_level == "sequence" and agg in ("token-mean",
                                                            "seq-mean-token-sum-norm"):
        warnings.warn(f"{p}importance_sampling_level='sequence' with {agg!r} sums per-token "
                      "terms, which weighs each sequence by its length; GSPO is "
                      "loss_type='grpo'", stacklevel=1)
    return agg


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: LossType | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: LossAgg | None = None,
    max_tokens: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    sampler_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    dual_clip: float | None = None,
    importance_sampling_level: ISLevel = "token",
    off_policy_mask_threshold: float | None = None,
    delta: float | None = None,
    sapo_temperature_pos: float = SAPO_TEMPERATURE_POS,
    sapo_temperature_neg: float = SAPO_TEMPERATURE_NEG,
) -> tuple[Tensor, dict[str, float]]:
    """The loss to minimise (gradients through ``logprobs`` only) and its metrics. ``A``: the
    advantage (``[B]`` or ``[B, T]``); ``r = exp(logp - old)`` per token, or with
    ``importance_sampling_level="sequence"`` (GSPO with ``grpo``) ``r = exp(mean_t(logp - old))``
    per sequence. The policy term ``ℓ_pg`` by ``loss_type``::

        None, grpo, bnpo, dr_grpo, dapo, luspo     (PPO-clip)
            s    = min(min(r, delta) · A, clip(r, 1 - clip_low, 1 + clip_high) · A)
            s    = max(s, dual_clip · A)   where A < 0                      (dual-clip, optional)
            ℓ_pg = -s
        cispo   ℓ_pg = -sg(min(r, clip_high)) · A · logp     (clip_high caps the weight itself)
        sapo    ℓ_pg = -(4/τ) σ(τ (r - 1)) · A,   τ = sapo_temperature_pos if A > 0, else _neg

        ℓ    = w · keep · ℓ_pg + kl_coef · KL_kind(logp, ref)
        loss = aggregate(ℓ, mask, agg)

    ``delta`` (INTELLECT-2's two-sided clip) is absent unless set. ``w = sg(min(exp(old -
    sampler), tis_cap))`` with truncated importance sampling, else 1. ``keep`` (DeepSeek-V3.2's
    off-policy mask, with ``off_policy_mask_threshold``) is 0 for a sequence with ``A < 0``
    whose ``mean_t(q - logp)`` exceeds the threshold, ``q`` being ``sampler_logprobs`` when
    given, else ``old_logprobs``; else 1. ``agg``: ``loss_type``'s as TRL (grpo, sapo:
    seq-mean-token-mean; bnpo, dapo, cispo: token-mean; dr_grpo: seq-mean-token-sum-norm;
    luspo: seq-mean-token-sum), else ``loss_agg``, else token-mean (TRL's default ``dapo``).
    Fractions are over tokens, or over sequences where ``r`` and ``A`` are per sequence.
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
    agg = check_objective(
        loss_type=loss_type, loss_agg=loss_agg, importance_sampling_level=importance_sampling_level,
        off_policy_mask_threshold=off_policy_mask_threshold, delta=delta, dual_clip=dual_clip,
        clip_high=clip_high, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, warn=False)

    m = mask.float()
    valid = m != 0
    lengths = m.sum(dim=1, keepdim=True)
    rows = lengths > 0  # [B, 1]: the sequences with a token
    logp = logprobs.float()
    adv = advantages.detach().float()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    # Zeroing the log-ratio at padding keeps exp() finite there (padding may hold any value).
    log_ratio = torch.where(valid, logp - old_logprobs.detach().float(), torch.zeros_like(logp))
    if importance_sampling_level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / lengths.clamp(min=1.0)
    ratio = torch.exp(log_ratio)  # [B, T] per token, [B, 1] per sequence
    zero = torch.zeros((), device=logp.device)
    flags: dict[str, Tensor] = {}
    if loss_type == "cispo":
        pg_tok = -ratio.clamp(max=clip_high).detach() * adv * logp
        flags["cispo_clip_frac"] = (ratio > clip_high) & (adv > 0)
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        pg_tok = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    else:
        clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        capped = ratio.clamp(max=delta) if delta is not None else ratio
        surrogate = torch.minimum(capped * adv, clipped * adv)
        flags["clip_frac_low"] = (ratio < 1.0 - clip_low) & (adv < 0)
        flags["clip_frac_high"] = (ratio > 1.0 + clip_high) & (adv > 0)
        if dual_clip is not None:
            surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)
            flags["dual_clip_frac"] = (ratio > dual_clip) & (adv < 0)
        if delta is not None:
            flags["delta_clip_frac"] = (ratio > delta) & (adv < 0)
        pg_tok = -surrogate
    pg_tok = pg_tok.expand(shape)

    dropped = torch.zeros_like(valid)
    if off_policy_mask_threshold is not None:
        q = (sampler_logprobs if sampler_logprobs is not None else old_logprobs).detach().float()
        drift = torch.where(valid, torch.nan_to_num(q - logp.detach(), nan=0.0), zero)
        mean_drift = drift.sum(dim=1, keepdim=True) / lengths.clamp(min=1.0)
        dropped = ((adv < 0) & (mean_drift > off_policy_mask_threshold)).expand(shape)
        pg_tok = torch.where(dropped, zero, pg_tok)

    weight = torch.ones_like(logp)
    if sampler_logprobs is not None and tis_cap is not None:
        tis_log = torch.where(valid, old_logprobs.float() - sampler_logprobs.float(),
                              torch.zeros_like(logp)).detach()
        weight = torch.exp(tis_log).clamp(max=tis_cap)
    pg_tok = weight * pg_tok

    if ref_logprobs is not None:
        ref = torch.where(valid, ref_logprobs.float(), logp.detach())
        kl_tok = kl_penalty(logp, ref, kl_kind)
    else:
        kl_tok = torch.zeros_like(logp)
    per_token = pg_tok + kl_coef * kl_tok if kl_coef != 0.0 else pg_tok
    loss = aggregate(per_token, m, agg, max_tokens)

    with torch.no_grad():
        r = ratio.detach()
        r_valid = rows if r.shape[1] == 1 else valid

        def frac(x: Tensor) -> Tensor:  # over sequences for a [B, 1] x, else over tokens
            return aggregate(x.float(), rows.float()) if x.shape[1] == 1 else aggregate(
                x.float().expand(shape), m)

        one = torch.ones((), device=r.device)
        capped_tis = weight >= tis_cap if tis_cap is not None else torch.zeros_like(valid)
        values = {
            "loss": loss.detach(),
            "pg_loss": aggregate(pg_tok.detach(), m, agg, max_tokens),
            "kl": aggregate(kl_tok.detach(), m),
            **{k: frac(flags[k]) if k in flags else zero for k in (
                "clip_frac_low", "clip_frac_high", "cispo_clip_frac", "dual_clip_frac",
                "delta_clip_frac")},
            "off_policy_masked_frac": frac((dropped & valid).any(dim=1, keepdim=True)),
            "ratio_mean": frac(r),
            "ratio_max": torch.where(r_valid, r, -torch.inf).max() if r.numel() else one,
            "ratio_min": torch.where(r_valid, r, torch.inf).min() if r.numel() else one,
            "tis_weight_mean": aggregate(weight, m),
            "tis_frac_capped": aggregate(capped_tis.float(), m),
        }
        # one device-to-host copy for all metrics, not one sync per value
        stacked = torch.stack([v.float().reshape(()) for v in values.values()]).tolist()
        metrics = dict(zip(values, stacked, strict=True))
        if math.isinf(metrics["ratio_max"]):  # no unmasked token at all
            metrics["ratio_max"] = metrics["ratio_min"] = 1.0
    return loss, metrics
