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

from grpo_nb.logprobs import linear_head, model_logprobs
from grpo_nb.objectives import (  # noqa: F401  the objectives live there; re-exported
    IS_LEVELS,
    KL_KINDS,
    LOSS_AGGS,
    LOSS_TYPE_AGG,
    LOSS_TYPES,
    OBJECTIVE_FIELDS,
    SAPO_TEMPERATURE_NEG,
    SAPO_TEMPERATURE_POS,
    ISLevel,
    KLKind,
    LossAgg,
    LossType,
    aggregate,
    check_objective,
    kl_penalty,
    policy_loss,
)

AdvScale = Literal["std", "none"]
ADV_SCALES = get_args(AdvScale)


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


def _check_logits(logits: Tensor, name: str, other: Tensor, temperature: float) -> None:
    if logits.dim() != 3 or other.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B,T,V] and {name} [B,T], got "
                         f"{tuple(logits.shape)} and {tuple(other.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


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
    _check_logits(logits, "token_ids", token_ids, temperature)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, v = logits.shape
    flat_logits = logits.reshape(b * t, v)
    flat_ids = token_ids.reshape(b * t).long()
    use_ckpt = torch.is_grad_enabled() and logits.requires_grad
    out = []
    for start in range(0, b * t, chunk_size):
        rows, ids = flat_logits[start:start + chunk_size], flat_ids[start:start + chunk_size]
        out.append(checkpoint(_chunk_logprobs, rows, ids, temperature, use_reentrant=False)
                   if use_ckpt else _chunk_logprobs(rows, ids, temperature))
    if not out:
        return logits.new_zeros((b, t), dtype=torch.float32)
    return torch.cat(out).view(b, t)


def next_token_logits(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``[B, L-1, V]``: a causal LM's logits at each position, which predict the next token."""
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]


def sequence_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor,
                      temperature: float, *, mask: Tensor | None = None) -> Tensor:
    """``[B, L-1]`` log-prob of each next token of ``input_ids`` under ``model`` (with grad);
    with ``mask`` only its set positions are computed (0 elsewhere). A plain linear head goes
    through :func:`grpo_nb.logprobs.model_logprobs`: no ``[B, L, V]`` logits tensor."""
    return sequence_logprobs_and_entropy(model, input_ids, attention_mask, temperature,
                                         mask=mask, entropy=False)[0]


def sequence_logprobs_and_entropy(
    model: Any, input_ids: Tensor, attention_mask: Tensor, temperature: float, *,
    mask: Tensor | None = None, entropy: bool = True
) -> tuple[Tensor, float]:
    """:func:`sequence_logprobs` and the :func:`masked_entropy` of the same distributions over
    ``mask`` (all positions without one; NaN when ``entropy`` is off), from one forward."""
    if linear_head(model) is not None:
        lp, ent = model_logprobs(model, input_ids, attention_mask, temperature, mask=mask,
                                 entropy=entropy)
        if ent is None:
            return lp, math.nan
        keep = torch.ones_like(ent, dtype=torch.bool) if mask is None else mask != 0
        return lp, float(ent[keep].sum()) / max(int(keep.sum()), 1)
    logits = next_token_logits(model, input_ids, attention_mask)
    lp = token_logprobs(logits, input_ids[:, 1:], temperature)
    if mask is not None:
        lp = torch.where(mask != 0, lp, torch.zeros((), device=lp.device))
    if not entropy:
        return lp, math.nan
    every = torch.ones(lp.shape, device=lp.device)
    return lp, masked_entropy(logits, every if mask is None else mask, temperature)


def masked_entropy(logits: Tensor, mask: Tensor, temperature: float = 1.0, *,
                   chunk_size: int = 512) -> float:
    """Token-mean entropy (nats) of ``softmax(logits / temperature)`` where ``mask`` is set."""
    _check_logits(logits, "mask", mask, temperature)
    with torch.no_grad():
        rows, cols = (mask != 0).nonzero(as_tuple=True)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for s in range(0, rows.numel(), chunk_size):
            z = logits[rows[s:s + chunk_size], cols[s:s + chunk_size]].float() / temperature
            total += torch.special.entr(torch.softmax(z, dim=-1)).sum()
        return float(total) / max(rows.numel(), 1)
