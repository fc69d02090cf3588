"""The LLM ring's configuration, validated at construction; fields left unset are resolved for
the model and precision (:func:`resolve_defaults`), and ``cfg.defaults`` says which and why."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args

from grpo_nb.grpo import (
    ADV_SCALES,
    LOSS_AGGS,
    LOSS_TYPE_AGG,
    SAPO_TEMPERATURE_NEG,
    SAPO_TEMPERATURE_POS,
    AdvScale,
    ISLevel,
    LossAgg,
    LossType,
    check_objective,
)
from grpo_nb.weight_sync import WeightSyncConfig

Mode = Literal["async", "sync"]
Overlong = Literal["zero", "filter", "soft"]
OVERLONGS = get_args(Overlong)

# Defaults by model family: the tiny character model learns at 3e-4; a pretrained Qwen-size
# model is RL-tuned at ~1e-6 (TRL's GRPO default).
TINY_LR, PRETRAINED_LR = 3e-4, 1e-6
MIXED_PRECISION_TIS_CAP = 2.0  # ratio_against="trainer" under bf16 (see resolve_defaults)
_CHOICES: dict[str, tuple[str, ...]] = {
    "mode": ("async", "sync"), "loss_agg": LOSS_AGGS, "adv_scale": ADV_SCALES,
    "ratio_against": ("sampler", "trainer"),  # "auto" is resolved before the check
    "device": ("auto", "cpu", "cuda"), "dtype": ("auto", "float32", "bfloat16"),
    "overlong": OVERLONGS}
_AT_LEAST: dict[str, int] = {
    "group_size": 2, "max_staleness": 0, "max_ahead": 0, "kl_coef": 0, "clip_low": 0,
    "clip_high": 0, "error_budget": 0, **dict.fromkeys(
        ("steps", "generators", "prompts_per_step", "grad_accum", "num_iterations", "sync_every",
         "verify_every", "max_tokens", "eval_every", "eval_size", "trainer_threads",
         "checkpoint_every", "max_prompt_len"), 1)}
_POSITIVE = ("lr", "temperature", "time_budget_s", "finish_timeout_s", "score_timeout_s",
             "max_grad_norm", "tis_cap", "checkpoint_every_s")


@dataclass
class LLMConfig:
    """Sizes, schedule and objective of the LLM GRPO ring (defaults: the full CPU run); the loss
    fields are :func:`grpo.policy_loss`'s. ``mode="async"`` keeps ``1 + max_ahead`` steps' worth
    of groups issued, ``"sync"`` one; groups over ``max_staleness`` versions old are dropped.
    ``ratio_against``: ``sampler`` takes vLLM's log-probs as the old policy, ``trainer``
    recomputes them (with ``tis_cap``)."""

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
    adv_scale: AdvScale = "std"
    lr: float | None = None  # resolved: TINY_LR / PRETRAINED_LR
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: LossAgg | None = None  # resolved: loss_type's, else "token-mean"
    kl_coef: float = 0.0
    tis_cap: float | None = None
    ratio_against: Literal["auto", "sampler", "trainer"] = "auto"
    dual_clip: float | None = None
    # TRL GRPOConfig's names and meanings (grpo.policy_loss): loss_type fixes the objective
    # and loss_agg (None: PPO-clip by loss_agg; with "cispo", clip_high caps the weight r);
    # "sequence" takes one ratio per sequence (with "grpo": GSPO); off_policy_mask_threshold
    # drops A < 0 sequences whose mean KL from the sampler exceeds it (DeepSeek-V3.2); delta
    # caps r for A < 0 (INTELLECT-2); SAPO's gate temperatures for A > 0 and A <= 0.
    loss_type: LossType | None = None
    importance_sampling_level: ISLevel = "token"
    off_policy_mask_threshold: float | None = None
    delta: float | None = None
    sapo_temperature_pos: float = SAPO_TEMPERATURE_POS
    sapo_temperature_neg: float = SAPO_TEMPERATURE_NEG
    # DAPO's dynamic sampling (ring.DynamicSampling): the trainer drops a group whose rewards
    # are all equal and credits a replacement, at most ring.DYNAMIC_DROP_CAP × prompts_per_step
    # a step (past that the step takes equal-reward groups too, and its row says dynamic_capped).
    dynamic_sampling: bool = False
    # A completion cut at max_tokens (finish_reason "length") scores 0 in every mode; "filter"
    # also masks it out of the loss (DAPO's overlong filtering; it still counts in its group's
    # advantages); "soft" adds DAPO's soft overlong punishment (rollouts.overlong_penalty) to
    # every completion's reward: 0 up to max_tokens - overlong_buffer tokens, then linearly
    # down to -1 at max_tokens.
    overlong: Overlong = "zero"
    overlong_buffer: int | None = None  # resolved for "soft": max_tokens // 4, at least 1
    error_budget: int = 8
    finish_timeout_s: float = 120.0
    # The Scorer's bound on one completion's reward (tasks.scoring): past it the completion
    # scores 0 and a "score_timeout" row is logged; a hang guard, not a budget.
    score_timeout_s: float = 30.0
    temperature: float = 1.0
    max_tokens: int | None = None
    eval_every: int = 25
    eval_size: int = 1000
    trainer_threads: int = 1
    checkpoint_every: int = 100
    # Also keep the weights (model + tokenizer) of the first step at or past every multiple of
    # this many training seconds, and of the last step, in runs/<name>/timed/ (None: off).
    checkpoint_every_s: float | None = None
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
        from grpo_nb.llm.placement import check_placement, ring_sync
        from grpo_nb.tasks import check_task_fields

        pause_why = None  # a sync dict without pause_mode: the ring's for its transport
        if isinstance(self.sync, dict):
            self.sync, pause_why = ring_sync(self.sync, self)
        check_task_fields(self)
        check_placement(self)
        self.defaults = resolve_defaults(self)
        if pause_why is not None:
            self.defaults["sync.pause_mode"] = pause_why
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"LLMConfig.{name}={getattr(self, name)!r}: use one of {choices}")
        for name, low in _AT_LEAST.items():
            if getattr(self, name) < low:
                raise ValueError(f"LLMConfig.{name}={getattr(self, name)}: must be >= {low}")
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and not value > 0:  # also rejects NaN
                raise ValueError(f"LLMConfig.{name}={value}: must be > 0")
        if not isinstance(self.dynamic_sampling, bool):
            raise ValueError(f"LLMConfig.dynamic_sampling={self.dynamic_sampling!r}: use True "
                             "or False")
        if self.overlong == "soft" and not (
                isinstance(self.overlong_buffer, int) and not isinstance(self.overlong_buffer, bool)
                and 1 <= self.overlong_buffer < self.max_tokens):
            raise ValueError(f"LLMConfig.overlong_buffer={self.overlong_buffer!r}: use an int, "
                             f"1 <= overlong_buffer < max_tokens={self.max_tokens} (the soft "
                             "punishment ramps over the last overlong_buffer tokens)")
        if self.overlong != "soft" and self.overlong_buffer is not None:
            raise ValueError(f"LLMConfig.overlong_buffer={self.overlong_buffer} does nothing with "
                             f"overlong={self.overlong!r}: it is the soft punishment's ramp; set "
                             "overlong='soft', or drop overlong_buffer")
        if self.max_inflight < self.group_size:
            raise ValueError(f"LLMConfig.max_inflight={self.max_inflight} < group_size="
                             f"{self.group_size}: a generator could never send one group")
        if self.prompts_per_step % self.grad_accum:
            raise ValueError(f"LLMConfig.prompts_per_step={self.prompts_per_step} is not "
                             f"divisible by grad_accum={self.grad_accum} (whole groups per "
                             "micro-batch)")
        # Combinations that could never make progress, or that would silently do nothing:
        if self.sync_every > self.max_staleness + 1:
            raise ValueError(
                f"LLMConfig.sync_every={self.sync_every} > max_staleness + 1 = "
                f"{self.max_staleness + 1}: a group's version only changes at a sync, so every "
                "group would be dropped as stale; lower sync_every or raise max_staleness")
        if not self.clip_low < 1.0:
            raise ValueError(f"LLMConfig.clip_low={self.clip_low}: use 0 <= clip_low < 1 (the "
                             "ratio's lower bound 1 - clip_low must stay positive)")
        if self.dual_clip is not None and not self.dual_clip > 1.0 + self.clip_high:
            raise ValueError(f"LLMConfig.dual_clip={self.dual_clip}: must be > 1 + clip_high = "
                             f"{1.0 + self.clip_high} (it caps ratios the clip left unbounded)")
        check_objective(loss_type=self.loss_type, loss_agg=self.loss_agg,
                        importance_sampling_level=self.importance_sampling_level,
                        off_policy_mask_threshold=self.off_policy_mask_threshold,
                        delta=self.delta, dual_clip=self.dual_clip, clip_high=self.clip_high,
                        sapo_temperature_pos=self.sapo_temperature_pos,
                        sapo_temperature_neg=self.sapo_temperature_neg, prefix="LLMConfig.")
        if self.ratio_against == "sampler" and self.tis_cap is not None:
            raise ValueError(
                f"LLMConfig.tis_cap={self.tis_cap} with ratio_against='sampler' does nothing: "
                "the ratio already divides by the sampler's log-probs; use "
                "ratio_against='trainer' with tis_cap, or drop tis_cap")
        if self.ratio_against == "trainer" and self.tis_cap is None:
            raise ValueError(
                "LLMConfig.ratio_against='trainer' needs tis_cap: the ratio is then exactly 1, "
                "and only the truncated importance weight min(pi_trainer / pi_sampler, tis_cap) "
                "corrects for stale samples. Set tis_cap (e.g. 2.0) or use ratio_against='sampler'")

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
        """The server's ``max_model_len``: the longest prompt kept plus ``max_tokens``."""
        return self.max_prompt_len + self.max_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> LLMConfig:
        """A validated copy with ``changes``; defaulted fields not named are resolved again."""
        data = {f.name: f.default if f.name in self.defaults else getattr(self, f.name)
                for f in fields(self)}
        if "sync.pause_mode" in self.defaults:
            data["sync"] = {k: v for k, v in asdict(self.sync).items() if k != "pause_mode"}
        return LLMConfig(**{**data, **changes})


def resolve_defaults(cfg: LLMConfig) -> dict[str, str]:
    """Fill ``cfg``'s unset fields for its model, data and precision: ``{field: "value (why)"}``."""
    from grpo_nb.llm.placement import dtype_of
    from grpo_nb.tasks import is_arithmetic_name
    from grpo_nb.tiny_model import is_tiny_model

    why: dict[str, str] = {}
    if cfg.loss_agg is None:  # an unknown loss_type is refused after this
        cfg.loss_agg = LOSS_TYPE_AGG.get(cfg.loss_type or "", "token-mean")
        why["loss_agg"] = f"{cfg.loss_agg} (" + (f"loss_type={cfg.loss_type!r}" if cfg.loss_type
                                                 else "PPO-clip's token mean: TRL's dapo") + ")"
    if cfg.max_tokens is None:
        cfg.max_tokens = 8 if is_arithmetic_name(cfg.dataset) else 256
        why["max_tokens"] = f"{cfg.max_tokens} (for {cfg.dataset!r}: 8 for arithmetic, 256 " \
                            "for math text)"
    if cfg.overlong == "soft" and cfg.overlong_buffer is None:
        cfg.overlong_buffer = max(1, cfg.max_tokens // 4)
        why["overlong_buffer"] = f"{cfg.overlong_buffer} (max_tokens // 4, for overlong='soft')"
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
