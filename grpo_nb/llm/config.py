"""The LLM ring's configuration: one dataclass, validated up front, with a ``smoke()`` preset.

Everything that changes what the ring does lives here, so a run is described by one object
(saved as ``runs/<name>/config.json``)::

    LLMConfig ──► llm.run.train() ──► tiny model + vLLM server + ring(mode, sizes, objective, sync)

Bad values are rejected in ``__post_init__`` with a message naming the field, before any
server is started.

Defaults that depend on the model family are resolved there too, from fields left unset
(``None`` / ``"auto"``); :attr:`LLMConfig.defaults` says which and why, and the run summary
prints it (:func:`resolve_defaults`; the chat template's own default, thinking off, is
resolved where prompts are rendered: :func:`grpo_nb.tasks.template_defaults`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from grpo_nb.grpo import LOSS_AGGS
from grpo_nb.weight_sync import WeightSyncConfig

Mode = Literal["async", "sync"]

# Defaults by model family (resolve_defaults): the tiny character model learns its arithmetic
# at 3e-4 (the README's full run: +34 points in 400 steps); a pretrained Qwen-size model is
# RL-tuned at ~1e-6 (TRL's GRPO default), where 3e-4 would be hundreds of times too large.
TINY_LR, PRETRAINED_LR = 3e-4, 1e-6
# ratio_against="trainer" caps the trainer/sampler weight here when the two sides compute in
# bfloat16 with different kernels (see resolve_defaults).
MIXED_PRECISION_TIS_CAP = 2.0
# What each defaulted field holds before it is resolved (LLMConfig.replace re-resolves them).
UNSET: dict[str, Any] = {"max_tokens": None, "lr": None, "ratio_against": "auto",
                         "tis_cap": None}


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
        finish_timeout_s: at the end of a run, how long each wait on a peer (a generator's
            drain, the next message of the stage before) may last; a peer that died or hangs
            then ends the run with an error naming it, instead of hanging it.
    Batch and objective
        prompts_per_step × group_size samples per step; ``grad_accum`` micro-batches.
        num_iterations: optimiser updates on each step's batch (GRPO's μ; TRL's name). From
            the second on, the trainer has moved since sampling, so the ratio leaves 1 and the
            clip bounds each update; the trainer does num_iterations × the work per step.
        lr, weight_decay, max_grad_norm: AdamW and gradient clipping (``lr=None``: 3e-4 for
            the tiny character model, 1e-6 for any other, pretrained, model).
        clip_low / clip_high / loss_agg / kl_coef / tis_cap: see :func:`grpo.policy_loss`.
        ratio_against: ``sampler`` uses vLLM's log-probs as the "old" policy (the ratio then
            measures how far the trainer has moved since sampling); ``trainer`` recomputes them
            (and needs ``tis_cap``). ``auto``: ``trainer`` with ``tis_cap`` 2 (unless set) when
            the run computes in bfloat16 — trainer (autocast) and server (vLLM's kernels) then
            round differently, so fresh samples have a ratio ≠ 1 from rounding alone — else
            ``sampler`` (float32 on both sides agrees to ~1e-6).
    Sampling and evaluation
        temperature, max_tokens (``None``: 8 for arithmetic, 256 for math text); eval_every
        steps, eval_size held-out problems, sampled greedily through the server.
    Model, data and reward (see :mod:`grpo_nb.tasks`)
        model: a local model folder or a hub id (``None``: the tiny character model).
        dataset: ``"arithmetic[:…]"``, a hub name (``"openai/gsm8k"``) or a local
            .json/.jsonl/.parquet file or folder in GSM8K or ``messages`` format;
            test_size: held out when the data has no test split (rows or fraction).
        system_prompt / chat_template_kwargs: the system turn, and extra template arguments;
            prompts use the model's chat template. Thinking is off
            (``{"enable_thinking": False}``) when the template takes ``enable_thinking``
            (Qwen3): its thinking block alone overruns ``max_tokens``, cutting every
            completion before its answer. ``{"enable_thinking": True}`` turns it back on.
        reward: a spec (``"auto"``, ``"math+0.1*format"``, ``"module:function"``) or a
            callable ``(completion_text, answer) -> float``.
        max_prompt_len: longer prompts are left out (counted); the server's context length
            is ``max_prompt_len + max_tokens`` (:attr:`context_len`).
    Placement
        device / dtype: ``auto`` = CUDA + bfloat16 when CUDA is present, else CPU + float32.
            The dtype is the server's and the trainer's compute dtype (bf16 autocast); the
            trainer's own weights and AdamW state stay float32 (:mod:`grpo_nb.llm.trainer`).
        kv_cache_mb / gpu_memory_utilization: the server's KV cache (``None``: derived from
            the model, the context length and the number of sequences in flight).
        sync.transport: ``gloo`` (the default) means "by device" on CUDA: ``nccl`` when the
            server has its own GPU, ``ipc`` when it shares the trainer's.
        sync.pause_mode: ``none`` (the default: generation goes on during a sync, the update
            runs between two engine steps) means ``keep`` on CUDA, where vLLM may schedule
            the next step while one runs.

    ``defaults`` (not a field): ``{field: "value (why)"}`` for the fields resolved from their
    unset value (:func:`resolve_defaults`); the run summary prints it.
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
    num_iterations: int = 1
    lr: float | None = None  # resolved: TINY_LR / PRETRAINED_LR
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0
    tis_cap: float | None = None
    ratio_against: Literal["auto", "sampler", "trainer"] = "auto"
    dual_clip: float | None = None
    error_budget: int = 8
    finish_timeout_s: float = 120.0
    temperature: float = 1.0
    max_tokens: int | None = None
    eval_every: int = 25
    eval_size: int = 1000
    trainer_threads: int = 1
    checkpoint_every: int = 100
    seed: int = 0
    model: str | None = None
    dataset: str = "arithmetic"
    test_size: int | float | None = None
    system_prompt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reward: Any = "auto"  # a spec string or a callable (completion_text, answer) -> float
    max_prompt_len: int = 256
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    kv_cache_mb: int | None = None
    gpu_memory_utilization: float | None = None
    sync: WeightSyncConfig = field(default_factory=lambda: WeightSyncConfig(pause_mode="none"))

    def __post_init__(self) -> None:
        if isinstance(self.sync, dict):
            self.sync = WeightSyncConfig(**self.sync)
        self._check_model_and_data()
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
        for name in ("steps", "generators", "prompts_per_step", "grad_accum", "num_iterations",
                     "sync_every", "verify_every", "max_tokens", "eval_every", "eval_size",
                     "trainer_threads", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"LLMConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.prompts_per_step % self.grad_accum:
            raise ValueError(f"LLMConfig.prompts_per_step={self.prompts_per_step} is not "
                             f"divisible by grad_accum={self.grad_accum} (whole groups per "
                             "micro-batch)")
        if not self.lr > 0:  # also rejects NaN
            raise ValueError(f"LLMConfig.lr={self.lr}: must be > 0")
        if self.temperature <= 0:
            raise ValueError(f"LLMConfig.temperature={self.temperature}: must be > 0")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"LLMConfig.loss_agg={self.loss_agg!r}: use one of {LOSS_AGGS}")
        if self.kl_coef < 0:
            raise ValueError(f"LLMConfig.kl_coef={self.kl_coef}: must be >= 0")
        if self.ratio_against not in ("sampler", "trainer"):  # "auto" is resolved by now
            raise ValueError(f"LLMConfig.ratio_against={self.ratio_against!r}: use 'auto', "
                             "'sampler' or 'trainer'")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"LLMConfig.time_budget_s={self.time_budget_s}: must be > 0")
        if not self.finish_timeout_s > 0:  # also rejects NaN
            raise ValueError(f"LLMConfig.finish_timeout_s={self.finish_timeout_s}: must be > 0 "
                             "(seconds each end-of-run wait on a peer may last)")
        self._check_off_policy()

    def _check_off_policy(self) -> None:
        """Combinations that could never make progress, or that would silently do nothing.

        ``error_budget``: failed requests per generator, and skipped (non-finite) steps, that
        the ring tolerates before it stops with the last cause. ``dual_clip``: see
        :func:`grpo.policy_loss`.
        """
        if self.sync_every > self.max_staleness + 1:
            # Versions only move at a sync, so just before the next one the freshest group is
            # sync_every - 1 steps old: with more, admission would drop every group for ever.
            raise ValueError(
                f"LLMConfig.sync_every={self.sync_every} > max_staleness + 1 = "
                f"{self.max_staleness + 1}: a group's version only changes at a sync, so after "
                f"max_staleness={self.max_staleness} steps without one every group would be "
                "dropped as stale and the run would never finish; lower sync_every or raise "
                "max_staleness")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"LLMConfig.clip_low={self.clip_low}: use 0 <= clip_low < 1 (the "
                             "ratio's lower bound 1 - clip_low must stay positive)")
        if self.clip_high < 0.0:
            raise ValueError(f"LLMConfig.clip_high={self.clip_high}: must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0 + self.clip_high:
            raise ValueError(f"LLMConfig.dual_clip={self.dual_clip}: must be > 1 + clip_high = "
                             f"{1.0 + self.clip_high} (it caps ratios the clip left unbounded)")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"LLMConfig.tis_cap={self.tis_cap}: must be > 0")
        if self.ratio_against == "sampler" and self.tis_cap is not None:
            raise ValueError(
                f"LLMConfig.tis_cap={self.tis_cap} with ratio_against='sampler' does nothing: "
                "the ratio already divides by the sampler's log-probs, so the truncated "
                "importance weight is always 1. Use ratio_against='trainer' with tis_cap, or "
                "drop tis_cap")
        if self.ratio_against == "trainer" and self.tis_cap is None:
            raise ValueError(
                "LLMConfig.ratio_against='trainer' needs tis_cap: the 'old' log-probs are then "
                "the trainer's own, so the ratio is exactly 1 and clipping never acts; only the "
                "truncated importance weight min(pi_trainer / pi_sampler, tis_cap) corrects for "
                "stale samples. Set tis_cap (e.g. 2.0) or use ratio_against='sampler'")
        if self.max_grad_norm <= 0:
            raise ValueError(f"LLMConfig.max_grad_norm={self.max_grad_norm}: must be > 0")
        if self.error_budget < 0:
            raise ValueError(f"LLMConfig.error_budget={self.error_budget}: must be >= 0")

    def _check_model_and_data(self) -> None:
        """Model, data, reward and placement fields; then the defaults they decide."""
        from grpo_nb.llm import placement

        kind = placement.check_dataset(self.dataset)
        placement.check_fields(self, "exact" if kind == "arithmetic" else "math")
        self.defaults = resolve_defaults(self)

    @classmethod
    def smoke(cls) -> LLMConfig:
        """A few minutes on 2 shared cores: fewer steps, smaller evaluation."""
        return cls(steps=50, time_budget_s=90.0, eval_every=25, eval_size=500,
                   checkpoint_every=25)

    @property
    def batch_size(self) -> int:
        """Samples per optimiser step."""
        return self.prompts_per_step * self.group_size

    @property
    def context_len(self) -> int:
        """The server's context length (``max_model_len``): the longest prompt kept plus
        ``max_tokens``. Every server that samples for this config takes it from here."""
        return self.max_prompt_len + self.max_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> LLMConfig:
        """A validated copy with some fields changed; defaulted fields not named in
        ``changes`` are resolved again (a new model or dataset brings its own defaults)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update({name: UNSET[name] for name in self.defaults})
        data.update(changes)
        return LLMConfig(**data)


def default_max_tokens(dataset: str) -> int:
    """What ``max_tokens=None`` becomes: 8 for the arithmetic family, 256 for math text."""
    from grpo_nb.tasks import is_arithmetic_name

    return 8 if is_arithmetic_name(dataset) else 256


def resolve_defaults(cfg: LLMConfig) -> dict[str, str]:
    """Fill ``cfg``'s unset fields (:data:`UNSET`) for its model, data and precision;
    returns ``{field: "value (why)"}`` for those it filled."""
    from grpo_nb.llm.placement import dtype_of
    from grpo_nb.tiny_model import is_tiny_model

    why: dict[str, str] = {}
    if cfg.max_tokens is None:
        cfg.max_tokens = default_max_tokens(cfg.dataset)
        why["max_tokens"] = f"{cfg.max_tokens} (for {cfg.dataset!r}: 8 for arithmetic, 256 " \
                            "for math text)"
    if cfg.lr is None:
        tiny = is_tiny_model(cfg.model)
        cfg.lr = TINY_LR if tiny else PRETRAINED_LR
        why["lr"] = f"{cfg.lr:g} (" + ("the tiny character model" if tiny else
                                       "a pretrained model: Qwen-scale RL fine-tuning") + ")"
    if cfg.ratio_against == "auto":
        bf16 = dtype_of(cfg) == "bfloat16"
        cfg.ratio_against = "trainer" if bf16 or cfg.tis_cap is not None else "sampler"
        if bf16:
            reason = "bfloat16: trainer and server round differently, so the sampler's " \
                     "log-probs are not the trainer's even for fresh samples"
        elif cfg.tis_cap is not None:
            reason = "tis_cap is set"
        else:
            reason = "float32 on both sides: the sampler's log-probs are the trainer's"
        why["ratio_against"] = f"{cfg.ratio_against} ({reason})"
        if cfg.ratio_against == "trainer" and cfg.tis_cap is None:
            cfg.tis_cap = MIXED_PRECISION_TIS_CAP
            why["tis_cap"] = f"{cfg.tis_cap:g} (with ratio_against='trainer')"
    return why
