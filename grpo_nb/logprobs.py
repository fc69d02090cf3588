"""Token log-probs of a causal LM from its final hidden states and ``lm_head``, chunk by chunk,
without a ``[B, L, V]`` logits tensor in forward or backward (as fused linear-cross-entropy
kernels do). :class:`LinearLogprobs` keeps one chunk's logits at a time; its backward recomputes
them. Rows are the positions the caller asks for (the completion tokens), log-prob math is
float32, and the head's matmul runs in the dtype autocast gives it (bf16 under the trainer's
autocast, as ``model(...).logits`` would be).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHUNK_BYTES = 1 << 28  # float32 bytes of one chunk's logits: 441 rows at Qwen3's 151,936 vocab


def default_chunk(vocab_size: int) -> int:
    """Rows per chunk for a vocabulary: a float32 chunk of logits of about ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (4 * max(vocab_size, 1)))


def _chunk_scores(logits: Tensor, temperature: float) -> Tensor:
    """float32 ``logits / temperature``; may reuse ``logits`` (a temporary) as its storage."""
    z = logits.float()
    return z.div_(temperature) if temperature != 1.0 else z


class LinearLogprobs(torch.autograd.Function):
    """``log softmax(head(h) / T)[y]`` per row (float32 ``[N]``), and the entropy of that
    distribution (float32 ``[N]``, no gradient; empty unless asked for).

    ``head`` is an ``nn.Linear`` whose ``weight`` and ``bias`` are passed as inputs, so that
    their gradients (a tied embedding's included) reach them. Forward calls ``head`` on each
    chunk (its hooks and autocast apply); backward recomputes the chunk with ``F.linear`` in
    the dtype forward's logits had. Saved for backward: ``hidden`` and one float32 log-sum-exp
    per row.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                head: nn.Module, temperature: float, chunk: int, want_entropy: bool
                ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=hidden.device)
        compute = hidden.dtype
        for s in range(0, n, chunk):
            logits = head(hidden[s:s + chunk])
            compute = logits.dtype
            z = _chunk_scores(logits, temperature)
            del logits
            rows_lse = torch.logsumexp(z, dim=-1)
            lse[s:s + chunk] = rows_lse
            logp[s:s + chunk] = z.gather(1, targets[s:s + chunk, None])[:, 0] - rows_lse
            if want_entropy:  # H = lse - Σ p z
                p = (z - rows_lse[:, None]).exp_()
                ent[s:s + chunk] = rows_lse - p.mul_(z).sum(-1)
                del p
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.compute, ctx.temperature, ctx.chunk = compute, temperature, chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, _grad_ent: Tensor | None
                 ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 5
        if grad_logp is None:
            return (None,) * 8
        cd, t, chunk = ctx.compute, ctx.temperature, ctx.chunk
        g_all = grad_logp.float()
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w \
            else None
        gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b \
            else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cd)
            b = bias.to(cd) if bias is not None else None
            for s in range(0, hidden.shape[0], chunk):
                h, g = hidden[s:s + chunk].to(cd), g_all[s:s + chunk, None]
                z = _chunk_scores(F.linear(h, w, b), t)
                # d logp / d z = onehot(y) - softmax(z), times the incoming gradient
                gz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(-g)
                gz.scatter_add_(1, targets[s:s + chunk, None], g)
                if t != 1.0:
                    gz.div_(t)
                if gb is not None:
                    gb += gz.sum(0)
                gl = gz.to(cd)
                del z, gz
                if gh is not None:
                    gh[s:s + chunk] = (gl @ w).to(hidden.dtype)
                if gw is not None:
                    if cd == torch.float32:
                        gw.addmm_(gl.t(), h)
                    else:
                        gw += gl.t() @ h
                del gl
        return (gh, gw.to(weight.dtype) if gw is not None else None,
                gb.to(bias.dtype) if gb is not None and bias is not None else None, *none)


def linear_logprobs(hidden: Tensor, head: nn.Linear, targets: Tensor, temperature: float = 1.0,
                    *, chunk_size: int | None = None, entropy: bool = False
                    ) -> tuple[Tensor, Tensor | None]:
    """float32 ``[N]`` log-probs of ``targets [N]`` under ``softmax(head(hidden) / T)`` for
    ``hidden [N, H]``, and the per-row entropy (nats, no gradient) when ``entropy``."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N,H] and targets [N], got {tuple(hidden.shape)} "
                         f"and {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = default_chunk(head.out_features) if chunk_size is None else chunk_size
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk}")
    logp, ent = LinearLogprobs.apply(hidden, head.weight, head.bias, targets.long(), head,
                                     float(temperature), chunk, entropy)
    return logp, ent if entropy else None


def linear_head(model: Any) -> nn.Linear | None:
    """The model's ``lm_head`` when its logits are exactly ``lm_head(base_model(...))`` (a plain
    linear head, no logit soft-capping or scaling), else None."""
    get = getattr(model, "get_output_embeddings", None)
    head, base = get() if callable(get) else None, getattr(model, "base_model", None)
    cfg = getattr(model, "config", None)
    scaled = getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None)
    plain = isinstance(head, nn.Linear) and base is not None and base is not model
    return head if plain and not scaled else None


def model_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor,
                   temperature: float = 1.0, *, mask: Tensor | None = None,
                   entropy: bool = False, chunk_size: int | None = None
                   ) -> tuple[Tensor, Tensor | None]:
    """float32 ``[B, L-1]`` log-prob of each next token of ``input_ids`` (with grad) and, when
    ``entropy``, the entropy of each position's distribution (no grad); where ``mask [B, L-1]``
    is given, only its set positions are computed and the others hold 0."""
    head = linear_head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no plain linear lm_head over a base model")
    b, width = input_ids.shape[0], input_ids.shape[1] - 1
    if mask is not None and mask.shape != (b, width):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {(b, width)}")
    # the base model's last hidden states: the input of lm_head
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              use_cache=False).last_hidden_state[:, :-1]
    keep = (torch.ones(b, width, dtype=torch.bool, device=hidden.device) if mask is None
            else mask.to(hidden.device) != 0)
    lp, ent = linear_logprobs(hidden[keep], head, input_ids[:, 1:][keep], temperature,
                              chunk_size=chunk_size, entropy=entropy)
    full = lp.new_zeros(b, width).masked_scatter(keep, lp)
    return full, lp.new_zeros(b, width).masked_scatter(keep, ent) if ent is not None else None
