"""One GRPO step taken apart (notebook 05): the aligned batch (completion token ``k`` of a
length-``p`` prompt sits at column ``p - 1 + k``), a loss checker, the server's log-probs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from grpo_nb import grpo
from grpo_nb.llm.data import Group
from grpo_nb.llm.policy import Batch


def alignment_rows(batch: Batch, i: int, tokenizer: Any, prompt_len: int) -> list[dict]:
    """Row ``i`` of the batch column by column: what each loss position predicts and holds."""
    ids = batch.input_ids[i].tolist()
    return [{"column t": t, "input token t": tokenizer.decode([ids[t]]),
             "predicts token t+1": tokenizer.decode([ids[t + 1]]),
             "part": "prompt" if t + 1 < prompt_len else "completion",
             "loss_mask": int(batch.loss_mask[i, t]),
             "sampler logp": round(float(batch.sampler_logprobs[i, t]), 4)}
            for t in range(int(batch.attention_mask[i].sum()) - 1)]


def draw_alignment(batch: Batch, prompt_lens: Sequence[int]) -> Any:
    """Loss mask and sampler log-probs of every row, with each row's ``p - 1`` marked."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(prompt_lens) + 1.6),
                             layout="constrained")
    mask = batch.loss_mask
    logp = torch.where(mask > 0, batch.sampler_logprobs, torch.full_like(mask, float("nan")))
    for ax, data, title, cmap in ((axes[0], mask, "loss_mask", "Greys"),
                                  (axes[1], logp, "sampler log-probs (masked)", "viridis")):
        im = ax.imshow(data.numpy(), aspect="auto", cmap=cmap, interpolation="nearest")
        ax.scatter([p - 1 for p in prompt_lens], range(len(prompt_lens)), marker="|",
                   s=120, color="tab:red", label="column p − 1")
        ax.set(title=title, xlabel="column t (predicts token t + 1)", ylabel="sample")
        fig.colorbar(im, ax=ax, shrink=0.8)
    axes[0].legend(loc="lower right", fontsize=8)
    return fig


def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(name, logp, old, advantages, mask) cases that tell a right loss from common slips."""
    gen = torch.Generator().manual_seed(0)
    b, t = 6, 9
    old = -torch.rand(b, t, generator=gen) * 3
    logp = old + torch.randn(b, t, generator=gen) * 0.6  # ratios ≈ 0.2 … 5: both clips act
    adv = torch.tensor([1.2, -0.8, 0.0, 0.5, -1.5, 0.9])
    lengths = torch.tensor([9, 3, 5, 1, 7, 2])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    padded = torch.where(mask > 0, logp, torch.full_like(logp, 5.0))  # junk after the end
    return [("random ratios, ragged lengths", logp, old, adv, mask),
            ("junk log-probs in the padding", padded, old, adv, mask),
            ("one sample, one token", logp[:1, :1], old[:1, :1], adv[:1], mask[:1, :1])]


def token_loss_problems(fn: Callable[..., torch.Tensor]) -> list[str]:
    """Where ``fn(logp, old, adv, mask)`` differs from :func:`grpo.policy_loss` in value or gradient."""
    problems = []
    for name, logp, old, adv, mask in _cases():
        mine_in, ref_in = logp.clone().requires_grad_(), logp.clone().requires_grad_()
        mine = fn(mine_in, old, adv, mask)
        ref, _ = grpo.policy_loss(ref_in, old, adv, mask, clip_low=0.2, clip_high=0.2)
        if not isinstance(mine, torch.Tensor) or mine.dim() != 0:
            return [f"{name}: return one scalar tensor (got {type(mine).__name__} "
                    f"{tuple(getattr(mine, 'shape', ()))})"]
        if not torch.allclose(mine.detach(), ref.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"{name}: loss {mine.item():.5f}, expected {ref.item():.5f}")
            continue
        (g_ref,) = torch.autograd.grad(ref, ref_in)
        g_mine = (torch.autograd.grad(mine, mine_in, allow_unused=True)[0]
                  if mine.requires_grad else None)
        if g_mine is None or not torch.allclose(g_mine, g_ref, rtol=1e-4, atol=1e-7):
            problems.append(f"{name}: same loss but a different gradient (does the gradient "
                            "flow through logp, and only at unmasked tokens?)")
    return problems


def served_logprobs(syncer: Any, groups: Sequence[Group]) -> list[torch.Tensor]:
    """The server's log-prob of each completion token under the weights it serves now, group by
    group."""
    pairs = [(g.prompt_ids, r) for g in groups for r in g.rollouts]
    rows = syncer.client.prompt_logprobs([list(p) + list(r.completion_ids) for p, r in pairs])
    return [torch.tensor(row[len(p) - 1:], dtype=torch.float64)
            for row, (p, _) in zip(rows, pairs, strict=True)]
