"""The LLM ring's configuration: one dataclass, validated up front, with a ``smoke()`` preset.

Everything that changes what the ring does lives here, so a run is described by one object
(saved as ``runs/<name>/config.json``)::

    LLMConfig ──► llm.run.train() ──► tiny model + vLLM server + ring(mode, sizes, objective, sync)

Bad values are rejected in ``__post_init__`` with a message naming the field, before any
server is started.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from grpo_nb.grpo import LOSS_AGGS
from grpo_nb.weight_sync import WeightSyncConfig

Mode = Literal["async", "sync"]


@dataclass
class LLMConfig:
    """Sizes, schedule and objective of the LLM GRPO ring (defaults: the full CPU run).

    Schedule
        mode: ``async`` (generation overlaps training) or ``sync`` (generate → train → sync).
        steps: optimiser steps to run; ``time_budget_s`` stops earlier when set.
        generators / max_inflight: rollout actors, and sequences each keeps in flight
            (a group of ``group_size`` completions is one request of ``n = group_size``).
        max_staleness: a group sampled with weights more than this many versions older than
            the trainer's is dropped (and counted), never trained on.
        max_ahead: async only — how many steps' worth of groups generators may produce
            beyond the current step (bounds the queue, hence the staleness).
        sync_every: push weights to the server every k optimiser steps.
        verify_every: prove the served weights equal the trainer's every k syncs (and always
            at the first and the last sync).
    Batch and objective
        prompts_per_step × group_size samples per step; ``grad_accum`` micro-batches.
        lr, weight_decay, max_grad_norm: AdamW and gradient clipping.
        clip_low / clip_high / loss_agg / kl_coef / tis_cap: see :func:`grpo.policy_loss`.
        ratio_against: ``sampler`` uses vLLM's log-probs as the "old" policy (the ratio then
            measures how far the trainer has moved since sampling); ``trainer`` recomputes them.
    Sampling and evaluation
        temperature, max_tokens; eval_every steps, eval_size test problems (greedy).
    """

    mode: Mode = "async"
    steps: int = 400
    time_budget_s: float | None = 540.0
    generators: int = 2
    max_inflight: int = 64
    max_staleness: int = 2
    max_ahead: int = 1
    sync_every: int = 1
    verify_every: int = 10
    prompts_per_step: int = 16
    group_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0
    tis_cap: float | None = None
    ratio_against: Literal["sampler", "trainer"] = "sampler"
    temperature: float = 1.0
    max_tokens: int = 8
    eval_every: int = 25
    eval_size: int = 1000
    trainer_threads: int = 1
    checkpoint_every: int = 100
    seed: int = 0
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    def __post_init__(self) -> None:
        if isinstance(self.sync, dict):
            self.sync = WeightSyncConfig(**self.sync)
        if self.mode not in ("async", "sync"):
            raise ValueError(f"LLMConfig.mode={self.mode!r}: use 'async' or 'sync'")
        if self.group_size < 2:
            raise ValueError(f"LLMConfig.group_size={self.group_size}: must be >= 2 (GRPO "
                             "compares samples of the same prompt)")
        if self.max_inflight < self.group_size:
            raise ValueError(f"LLMConfig.max_inflight={self.max_inflight} < group_size="
                             f"{self.group_size}: a generator could never send one group")
        if self.max_staleness < 0:
            raise ValueError(f"LLMConfig.max_staleness={self.max_staleness}: must be >= 0")
        if self.max_ahead < 0:
            raise ValueError(f"LLMConfig.max_ahead={self.max_ahead}: must be >= 0")
        for name in ("steps", "generators", "prompts_per_step", "grad_accum", "sync_every",
                     "verify_every",
                     "max_tokens", "eval_every", "eval_size", "trainer_threads",
                     "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"LLMConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.prompts_per_step % self.grad_accum:
            raise ValueError(f"LLMConfig.prompts_per_step={self.prompts_per_step} is not "
                             f"divisible by grad_accum={self.grad_accum} (whole groups per "
                             "micro-batch)")
        if self.lr <= 0:
            raise ValueError(f"LLMConfig.lr={self.lr}: must be > 0")
        if self.temperature <= 0:
            raise ValueError(f"LLMConfig.temperature={self.temperature}: must be > 0")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"LLMConfig.loss_agg={self.loss_agg!r}: use one of {LOSS_AGGS}")
        if self.kl_coef < 0:
            raise ValueError(f"LLMConfig.kl_coef={self.kl_coef}: must be >= 0")
        if self.ratio_against not in ("sampler", "trainer"):
            raise ValueError(f"LLMConfig.ratio_against={self.ratio_against!r}: use 'sampler' "
                             "or 'trainer'")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"LLMConfig.time_budget_s={self.time_budget_s}: must be > 0")

    @classmethod
    def smoke(cls) -> LLMConfig:
        """A few minutes on 2 shared cores: fewer steps, smaller evaluation."""
        return cls(steps=50, time_budget_s=90.0, eval_every=25, eval_size=500,
                   checkpoint_every=25)

    @property
    def batch_size(self) -> int:
        """Samples per optimiser step."""
        return self.prompts_per_step * self.group_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> LLMConfig:
        """A validated copy with some fields changed."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(changes)
        return LLMConfig(**data)
