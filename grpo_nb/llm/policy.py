"""The LLM trainer's torch work, testable without a server: loading, batching, the GRPO step,
checkpoints. Weights are float32 masters (bf16 would round lr-1e-6 updates away);
``serve_dtype`` (``placement.dtype_of(cfg)``, the dtype the server runs in) sets the autocast
dtype and the one :class:`ChangeMeter` counts changes in. This module sends nothing: the weight
syncer casts the masters to the dtype they travel in (``WeightSyncer.send_dtype``:
``WeightSyncConfig.send_dtype``, else the server's)."""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.nn.utils.rnn import pad_sequence

from grpo_nb import grpo
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, Rollout


@dataclass
class Batch:
    """Right-padded tensors for a list of groups (``L`` = longest prompt + completion)."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1]: 1 where position t+1 is a completion token
    sampler_logprobs: torch.Tensor  # [B, L-1], 0 outside the mask
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor  # [B]


def _aligned(per_token: list[list[float]], prompt_lens: list[int], width: int) -> torch.Tensor:
    """Place each completion's per-token values at its positions in the shifted sequence."""
    out = torch.zeros(len(per_token), width)
    for i, (vals, p) in enumerate(zip(per_token, prompt_lens, strict=True)):
        out[i, p - 1:p - 1 + len(vals)] = torch.tensor(vals, dtype=torch.float32)
    return out


def make_batch(groups: list[Group], pad_id: int) -> Batch:
    """Stack groups into one right-padded batch (sequences are prompt + completion); a rollout
    marked ``masked`` (``overlong="filter"``) keeps its row, with no position in the loss."""
    pairs = [(g.prompt_ids, r) for g in groups for r in g.rollouts]
    batch = _batch(pairs, pad_id)
    batch.loss_mask[[i for i, (_, r) in enumerate(pairs) if r.masked]] = 0.0
    return batch


def _batch(pairs: Sequence[tuple[list[int], Rollout]], pad_id: int) -> Batch:
    """``(prompt ids, rollout)`` pairs as one right-padded batch."""
    rollouts = [r for _, r in pairs]
    seqs = [torch.tensor(list(p) + r.completion_ids) for p, r in pairs]
    prompt_lens = [len(p) for p, _ in pairs]
    refs = [r.ref_logprobs for r in rollouts if r.ref_logprobs is not None]
    ids = pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    attn = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True)
    width = ids.shape[1] - 1
    ones = [[1.0] * len(r.completion_ids) for r in rollouts]
    return Batch(ids, attn, _aligned(ones, prompt_lens, width),
                 _aligned([r.sampler_logprobs for r in rollouts], prompt_lens, width),
                 _aligned(refs, prompt_lens, width) if len(refs) == len(seqs) else None,
                 torch.tensor([r.advantage for r in rollouts], dtype=torch.float32))


@torch.no_grad()
def completion_logprobs(model: Any, groups: Sequence[Group], temperature: float = 1.0,
                        chunk: int = 64) -> list[torch.Tensor]:
    """Each rollout's completion-token log-probs under ``model`` (float32, on the CPU), group by
    group."""
    dev, out = next(model.parameters()).device, []
    pairs = [(g.prompt_ids, r) for g in groups for r in g.rollouts]
    for start in range(0, len(pairs), chunk):
        part = pairs[start:start + chunk]
        b = _batch(part, pad_id=0)  # right padding cannot change earlier tokens' log-probs
        lp = grpo.sequence_logprobs(model, b.input_ids.to(dev), b.attention_mask.to(dev),
                                    temperature, mask=b.loss_mask.to(dev)).float().cpu()
        out += [lp[i][b.loss_mask[i] > 0] for i in range(len(part))]
    return out


def load_policy(model_dir: str | Path, device: str = "cpu", dtype: str = "float32",
                *, trainable: bool = True) -> tuple[Any, Any]:
    """``(model, tokenizer)`` on ``device``: float32 when trainable, else frozen in ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    held = torch.float32 if trainable else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=held).to(device)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return (model, tokenizer) if trainable else (model.eval().requires_grad_(False), tokenizer)


CHANGE_SAMPLE = 1 << 24  # parameter elements compared per update (every one below this)


class ChangeMeter:
    """The fraction of parameter elements one update changed (over every k-th beyond
    ``CHANGE_SAMPLE``): :meth:`after` gives it as trained and as cast to ``send_dtype``."""

    def __init__(self, params: list[torch.Tensor], send_dtype: torch.dtype) -> None:
        self.params, self.send_dtype = params, send_dtype
        self.stride = max(1, math.ceil(sum(p.numel() for p in params) / CHANGE_SAMPLE))
        self.kept: list[torch.Tensor] = []

    def before(self) -> None:
        self.kept = [p.detach().reshape(-1)[::self.stride].clone() for p in self.params]

    def after(self) -> tuple[float, float]:
        changed = sent = total = 0
        for p, old in zip(self.params, self.kept, strict=True):
            new = p.detach().reshape(-1)[::self.stride]
            changed += int((new != old).sum())
            sent += int((new.to(self.send_dtype) != old.to(self.send_dtype)).sum())
            total += old.numel()
        self.kept = []
        return changed / max(total, 1), sent / max(total, 1)


class PolicyTrainer:
    """Model (float32 masters) + AdamW; one GRPO step at a time under :meth:`autocast`."""

    def __init__(self, model: Any, tokenizer: Any, cfg: LLMConfig) -> None:
        from grpo_nb.llm.placement import dtype_of

        cfg = cfg.resolve()  # a resolved config is kept as it is
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.serve_dtype: torch.dtype = getattr(torch, dtype_of(cfg))
        model.float()  # in place: whoever holds the model (the syncer) sees the masters
        self.model.train()
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                     weight_decay=cfg.weight_decay)
        self.changes = ChangeMeter(list(model.parameters()), self.serve_dtype)
        if next(model.parameters()).is_cuda and not model.is_gradient_checkpointing:
            model.gradient_checkpointing_enable()  # memory for long sequences on GPU
            model.config.use_cache = False  # a KV cache is useless with checkpointing
        self.step_count = 0
        self.version = 0  # weight version the server last confirmed
        self.last_verified: int | None = None  # last version proven served (probe check)
        self.skipped = 0  # steps not taken: non-finite loss or gradient
        self.last_changed = (0.0, 0.0)  # ChangeMeter.after() of the last optimiser update

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def autocast(self) -> Any:
        """A forward under it computes in ``serve_dtype`` (bf16 autocast; no-op in float32)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.serve_dtype == torch.bfloat16)

    def step(self, groups: list[Group]) -> dict[str, Any]:
        """``num_iterations`` updates on ``groups`` (``grad_accum`` micro-batches each); the
        metrics row. A non-finite first update skips the step (the row says ``skipped``)."""
        cfg = self.cfg
        per_micro = max(1, len(groups) // cfg.grad_accum)
        micro = [groups[i:i + per_micro] for i in range(0, len(groups), per_micro)]
        batches = [make_batch(m, self.tokenizer.pad_token_id) for m in micro]
        # ratio_against="trainer": the "old" policy is the trainer before this step's first
        # update, kept for the later ones (else their ratio would be 1 again).
        olds: list[torch.Tensor | None] = [None] * len(batches)
        # The batch's loss = Σ micro weight_i · loss_i: token-mean weighs by tokens (TRL's
        # dapo / cispo: the accumulated batch's tokens), bnpo (each micro-batch's own tokens)
        # and the per-sequence modes by rows (micro-batches may differ in size).
        by_tokens = cfg.loss_agg == "token-mean" and cfg.loss_type != "bnpo"
        sizes = [float(b.loss_mask.sum() if by_tokens else len(b.advantages)) for b in batches]
        weights = [n / max(sum(sizes), 1.0) for n in sizes]
        done, sums, grad_norm, changed = 0, {}, math.nan, (0.0, 0.0)
        for _ in range(cfg.num_iterations):
            bad, update_sums, update_norm = self._update(batches, weights, olds)
            if bad is not None and done == 0:
                self.skipped += 1
                return {"step": self.step_count, "skipped": bad, "skipped_steps": self.skipped}
            if bad is not None:
                break  # the updates made stand: the row's "updates" says how many
            done, sums, grad_norm = done + 1, update_sums, update_norm
            changed = self.last_changed
        self.step_count += 1
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        rollouts = [r for g in groups for r in g.rollouts]
        lengths = [len(r.completion_ids) for r in rollouts]
        return {
            "step": self.step_count, "loss": sums.get("loss", 0.0), "kl": sums.get("kl", 0.0),
            "clip_frac": sums.get("clip_frac_low", 0.0) + sums.get("clip_frac_high", 0.0),
            "ratio_mean": sums.get("ratio_mean", 1.0),
            **{k: sums.get(k, 0.0) for k in ("cispo_clip_frac", "dual_clip_frac",
                                              "delta_clip_frac", "off_policy_masked_frac")},
            "tis_weight_mean": sums.get("tis_weight_mean", 1.0),
            "tis_capped_frac": sums.get("tis_frac_capped", 0.0),
            "ratio_max": sums.get("ratio_max", 1.0), "grad_norm": grad_norm,
            "updates": done, "step_changed_frac": changed[0], "sent_changed_frac": changed[1],
            "reward": float(rewards.mean()), "tokens": int(sum(lengths)),
            "response_len": sum(lengths) / max(len(lengths), 1),
            "entropy": sums.get("entropy", math.nan),
            "truncated_frac": sum(r.finish_reason == "length" for r in rollouts)
            / max(len(rollouts), 1),
            "masked_frac": sum(r.masked for r in rollouts) / max(len(rollouts), 1),
            "zero_std_groups": grpo.zero_std_groups(rewards, cfg.group_size),
            "zero_std_frac": grpo.zero_std_fraction(rewards, cfg.group_size),
            "skipped_steps": self.skipped,
        }

    def _update(self, batches: list[Batch], weights: list[float],
                olds: list[torch.Tensor | None]) -> tuple[str | None, dict[str, float], float]:
        """One optimiser update over every micro-batch: (why it was skipped, metrics, norm)."""
        self.opt.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        tokens = [float(b.loss_mask.sum()) for b in batches]
        rows = [len(b.advantages) for b in batches]
        for i, (b, weight) in enumerate(zip(batches, weights, strict=True)):
            loss, metrics = self._micro_loss(b, olds, i)
            if not torch.isfinite(loss):
                self.opt.zero_grad(set_to_none=True)
                return f"loss={float(loss.detach())}", sums, math.nan
            (loss * weight).backward()
            for k, v in metrics.items():
                if k == "ratio_max":  # the largest over the micro-batches, not a mean
                    sums[k] = max(sums.get(k, v), v)
                    continue
                w = weight  # entropy is a token-mean, the masked fraction a sequence-mean,
                if k == "entropy":  # whatever loss_agg weighs the loss by
                    w = tokens[i] / max(sum(tokens), 1.0)
                elif k == "off_policy_masked_frac":
                    w = rows[i] / max(sum(rows), 1)
                sums[k] = sums.get(k, 0.0) + w * v
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                         self.cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.opt.zero_grad(set_to_none=True)
            return f"grad_norm={grad_norm}", sums, grad_norm
        self.changes.before()
        self.opt.step()
        self.last_changed = self.changes.after()
        return None, sums, grad_norm

    def _micro_loss(self, b: Batch, olds: list[torch.Tensor | None], i: int
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg, dev = self.cfg, self.device
        ids, attn, mask = b.input_ids.to(dev), b.attention_mask.to(dev), b.loss_mask.to(dev)
        with self.autocast():  # the backward follows the forward's dtypes
            # completion positions only (0 elsewhere); the entropy from the same logits, no
            # gradient, float32
            logp, entropy = grpo.sequence_logprobs_and_entropy(self.model, ids, attn,
                                                               cfg.temperature, mask=mask)
        sampler = b.sampler_logprobs.to(dev)
        extra: dict[str, Any] = {}
        if cfg.ratio_against == "sampler":
            old = sampler
        else:
            if olds[i] is None:
                olds[i] = logp.detach()
            old = olds[i]
            if cfg.tis_cap is not None:
                extra = {"sampler_logprobs": sampler, "tis_cap": cfg.tis_cap}
        ref = b.ref_logprobs.to(dev) if b.ref_logprobs is not None and cfg.kl_coef else None
        loss, metrics = grpo.policy_loss(
            logp, old, b.advantages.to(dev), mask, clip_low=cfg.clip_low,
            clip_high=cfg.clip_high, loss_agg=cfg.loss_agg, max_tokens=cfg.max_tokens,
            dual_clip=cfg.dual_clip, ref_logprobs=ref,
            kl_coef=cfg.kl_coef if ref is not None else 0.0, **extra,
            **{k: getattr(cfg, k) for k in grpo.OBJECTIVE_FIELDS})
        return loss, {**metrics, "entropy": entropy}

    def save(self, folder: Path | str, extra: dict[str, Any] | None = None) -> Path:
        """Write model (HF format), tokenizer, optimizer and counters into a new folder, fsynced,
        switch the ``folder`` link to it by one atomic rename, and only then remove older ones:
        a crash at any moment leaves a complete checkpoint."""
        state = {"step": self.step_count, "version": self.version,
                 "skipped_steps": self.skipped, **(extra or {})}
        link = Path(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        name = f"ckpt-{int(state['step']):06d}-{uuid.uuid4().hex[:6]}"
        tmp = link.parent / f"{name}.tmp"
        tmp.mkdir()
        self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        torch.save(self.opt.state_dict(), tmp / "optimizer.pt")
        (tmp / STATE).write_text(json.dumps(state, indent=1))
        _fsync(*(p for p in tmp.rglob("*") if p.is_file()), tmp)
        tmp.rename(link.parent / name)
        staged = link.parent / f"{link.name}.tmp-link"
        staged.unlink(missing_ok=True)
        staged.symlink_to(name)  # relative: the run folder can be moved
        os.replace(staged, link)  # the atomic switch
        _fsync(link.parent)
        for old in link.parent.glob("ckpt-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        return link

    def load(self, folder: Path | str) -> dict[str, Any]:
        """Restore a :meth:`save` folder into this trainer; returns its saved counters."""
        folder = resolve_checkpoint(folder)
        weights = load_file(str(folder / "model.safetensors"))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise ValueError(f"checkpoint {folder} does not fit the model: missing={missing} "
                             f"unexpected={unexpected}")
        self.opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
        saved = json.loads((folder / STATE).read_text())
        self.step_count = int(saved["step"])
        self.skipped = int(saved["skipped_steps"])
        return saved


STATE = "trainer_state.json"  # written last: its presence marks a complete checkpoint folder


def _fsync(*paths: Path) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)  # a file or a folder (its entries)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def resolve_checkpoint(folder: Path | str) -> Path:
    """``folder`` if it holds a complete checkpoint: the link :meth:`PolicyTrainer.save` switches
    only ever names one (a ``ckpt-*`` folder it never linked to was not committed)."""
    folder = Path(folder)
    if not (folder / STATE).is_file():
        raise FileNotFoundError(f"no complete checkpoint at {folder}")
    return folder
