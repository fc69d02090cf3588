"""The LLM ring's configuration: constructing an :class:`LLMConfig` checks every field (no
device, no data touched); :meth:`LLMConfig.resolve` fills the fields left unset for the model,
data, device and precision, returning a new config whose ``defaults`` says which and why."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Any, ClassVar, Literal

from grpo_nb.config import Fraction, Ge, Lt, NonNegFloat, NonNegInt, PosFloat, PosInt, check_fields
from grpo_nb.grpo import (
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

# Defaults by model family: the tiny character model learns at 3e-4; a pretrained Qwen-size
# model is RL-tuned at ~1e-6 (TRL's GRPO default).
TINY_LR, PRETRAINED_LR = 3e-4, 1e-6
MIXED_PRECISION_TIS_CAP = 2.0  # ratio_against="trainer" under bf16 (see LLMConfig.resolve)


@dataclass
class LLMConfig:
    """Sizes, schedule and objective of the LLM GRPO ring (defaults: the full CPU run); the loss
    fields are :func:`grpo.policy_loss`'s. ``None``/``"auto"`` fields are filled by
    :meth:`resolve`, which ``train`` and the CLI call."""

    # "async" keeps 1 + max_ahead steps' worth of groups issued, "sync" one step's worth
    mode: Literal["async", "sync"] = "async"
    steps: PosInt = 400  # optimiser steps at most
    time_budget_s: PosFloat | None = 540.0  # seconds of training at most (None: no bound)
    generators: PosInt = 2  # generator actors sharing the server
    max_inflight: PosInt = 64  # requests one generator keeps in flight (≥ group_size)
    max_staleness: NonNegInt = 2  # groups sampled more versions ago than this are dropped
    max_ahead: NonNegInt = 1  # steps' worth of groups issued beyond the current one (async)
    sync_every: PosInt = 1  # optimiser steps between weight syncs
    verify_every: PosInt = 10  # syncs between checks that the server holds the trainer's weights
    prompts_per_step: PosInt = 16  # groups (prompts) per optimiser step
    group_size: Annotated[int, Ge(2)] = 8  # G completions of one prompt form a GRPO group
    grad_accum: PosInt = 1  # micro-batches per step (divides prompts_per_step)
    num_iterations: PosInt = 1  # updates per step on the same batch (μ in the GRPO paper)
    adv_scale: AdvScale = "std"  # "none": advantages not divided by the group's std (Dr. GRPO)
    lr: PosFloat | None = None  # AdamW's; None: TINY_LR or PRETRAINED_LR by the model
    weight_decay: NonNegFloat = 0.0  # AdamW's
    max_grad_norm: PosFloat = 1.0  # gradients clipped to this global norm
    clip_low: Annotated[float, Ge(0), Lt(1)] = 0.2  # the ratio's lower bound is 1 - clip_low
    clip_high: NonNegFloat = 0.2  # and its upper bound 1 + clip_high
    loss_agg: LossAgg | None = None  # how token terms are averaged; None: loss_type's, else token-mean
    kl_coef: NonNegFloat = 0.0  # weight of the KL penalty to the reference model (0: none)
    tis_cap: PosFloat | None = None  # truncated importance weight cap (ratio_against="trainer")
    # the old policy of the ratio: "sampler" takes vLLM's log-probs, "trainer" recomputes them
    # (with tis_cap); "auto": "trainer" under bfloat16 or with tis_cap set, else "sampler"
    ratio_against: Literal["auto", "sampler", "trainer"] = "auto"
    dual_clip: float | None = None  # dual-clip PPO's cap on ratios of A < 0 (> 1 + clip_high)
    # TRL GRPOConfig's names and meanings (grpo.policy_loss): loss_type fixes the objective
    # and loss_agg (None: PPO-clip by loss_agg; with "cispo", clip_high caps the weight r)
    loss_type: LossType | None = None
    importance_sampling_level: ISLevel = "token"  # "sequence": one ratio per sequence (GSPO)
    off_policy_mask_threshold: float | None = None  # drop A < 0 sequences whose mean KL from
    # the sampler exceeds it (DeepSeek-V3.2)
    delta: float | None = None  # caps r for A < 0 (INTELLECT-2)
    sapo_temperature_pos: float = SAPO_TEMPERATURE_POS  # SAPO's gate temperature for A > 0
    sapo_temperature_neg: float = SAPO_TEMPERATURE_NEG  # and for A <= 0
    # DAPO's dynamic sampling (ring.DynamicSampling): the trainer drops a group whose rewards
    # are all equal and credits a replacement, at most ring.DYNAMIC_DROP_CAP × prompts_per_step
    # a step (past that the step takes equal-reward groups too, and its row says dynamic_capped).
    dynamic_sampling: bool = False
    # A completion cut at max_tokens (finish_reason "length") scores 0 in every mode; "filter"
    # also masks it out of the loss (DAPO's overlong filtering; it still counts in its group's
    # advantages); "soft" adds DAPO's soft overlong punishment (rollouts.overlong_penalty) to
    # every completion's reward: 0 up to max_tokens - overlong_buffer tokens, then linearly
    # down to -1 at max_tokens.
    overlong: Literal["zero", "filter", "soft"] = "zero"
    overlong_buffer: PosInt | None = None  # the soft ramp's tokens; None: max_tokens // 4
    error_budget: NonNegInt = 8  # failed requests (or bad steps) an actor tolerates
    finish_timeout_s: PosFloat = 120.0  # how long an actor may take to finish at the end
    # The Scorer's bound on one completion's reward (tasks.scoring): past it the completion
    # scores 0 and a "score_timeout" row is logged; a hang guard, not a budget.
    score_timeout_s: PosFloat = 30.0
    temperature: PosFloat = 1.0  # sampling temperature (the log-probs are taken at it)
    max_tokens: PosInt | None = None  # tokens per completion; None: 8 arithmetic, 256 text
    eval_every: PosInt = 25  # steps between evaluations on the test split
    eval_size: PosInt = 1000  # test prompts per evaluation
    trainer_threads: PosInt = 1  # torch threads of the trainer (when not pinned)
    checkpoint_every: PosInt = 100  # steps between checkpoints
    # Also keep the weights (model + tokenizer) of the first step at or past every multiple of
    # this many training seconds, and of the last step, in runs/<name>/timed/ (None: off).
    checkpoint_every_s: PosFloat | None = None
    seed: int = 0  # sampling seeds and the trainer's torch seed
    model: str | None = None  # a model folder or hub id; None: the tiny model (built if needed)
    dataset: str = "arithmetic"  # "arithmetic[:…]", a hub name, or a .json/.jsonl/.parquet path
    test_size: int | float | None = None  # test rows (or fraction); None: the data's test split
    system_prompt: str | None = None  # prepended as the chat's system message
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template
    reward: Any = "auto"  # a spec string or a callable (completion_text, answer) -> float
    max_prompt_len: PosInt = 256  # longer prompts are left out (counted)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # "auto": CUDA where torch sees it
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # "auto": bfloat16 on CUDA
    kv_cache_mb: PosInt | None = None  # the server's KV cache; None: sized for the ring (CPU)
    gpu_memory_utilization: Fraction | None = None  # the server's; None: sized by placement
    # how weights travel; a dict without pause_mode gets the ring's for its transport (resolve)
    sync: WeightSyncConfig = field(default_factory=lambda: WeightSyncConfig(pause_mode="none"))
    # set on resolve()'s copy: {field: "value (why)"} for each field it filled; None: unresolved
    defaults: ClassVar[dict[str, str] | None] = None

    def __post_init__(self) -> None:
        from grpo_nb.llm.placement import check_model
        from grpo_nb.tasks import check_task_fields

        if isinstance(self.sync, dict):  # the pause mode is the ring's unless given
            self.sync = WeightSyncConfig(**{"pause_mode": "auto", **self.sync})
        check_fields(self)
        check_task_fields(self)
        check_model(self.model)
        soft, buffer, max_tokens = self.overlong == "soft", self.overlong_buffer, self.max_tokens
        for name, bad, why in (
            ("overlong_buffer", soft and buffer and max_tokens and buffer >= max_tokens,
             f"use 1 <= overlong_buffer < max_tokens={max_tokens} (the soft punishment ramps "
             "over the last overlong_buffer tokens)"),
            ("overlong_buffer", not soft and buffer is not None,
             f"does nothing with overlong={self.overlong!r}: it is the soft punishment's ramp; "
             "set overlong='soft', or drop overlong_buffer"),
            ("max_inflight", self.max_inflight < self.group_size,
             f"< group_size={self.group_size}: a generator could never send one group"),
            ("prompts_per_step", self.prompts_per_step % self.grad_accum,
             f"is not divisible by grad_accum={self.grad_accum} (whole groups per micro-batch)"),
            # a group's version only changes at a sync: every group would be dropped as stale
            ("sync_every", self.sync_every > self.max_staleness + 1,
             f"> max_staleness + 1 = {self.max_staleness + 1}: every group would be dropped "
             "as stale; lower sync_every or raise max_staleness"),
            ("dual_clip", self.dual_clip is not None and not self.dual_clip > 1 + self.clip_high,
             f"must be > 1 + clip_high = {1.0 + self.clip_high} (it caps ratios the clip left "
             "unbounded)"),
            ("tis_cap", self.ratio_against == "sampler" and self.tis_cap is not None,
             "with ratio_against='sampler' does nothing: the ratio already divides by the "
             "sampler's log-probs; use ratio_against='trainer' with tis_cap, or drop tis_cap"),
            ("ratio_against", self.ratio_against == "trainer" and self.tis_cap is None,
             "needs tis_cap: the ratio is then exactly 1, and only the truncated importance "
             "weight min(pi_trainer / pi_sampler, tis_cap) corrects for stale samples. Set "
             "tis_cap (e.g. 2.0) or use ratio_against='sampler'")):
            if bad:
                raise ValueError(f"LLMConfig.{name}={getattr(self, name)!r} {why}")
        check_objective(loss_type=self.loss_type, loss_agg=self.loss_agg,
                        importance_sampling_level=self.importance_sampling_level,
                        off_policy_mask_threshold=self.off_policy_mask_threshold,
                        delta=self.delta, dual_clip=self.dual_clip, clip_high=self.clip_high,
                        sapo_temperature_pos=self.sapo_temperature_pos,
                        sapo_temperature_neg=self.sapo_temperature_neg, prefix="LLMConfig.")

    def resolve(self) -> LLMConfig:
        """A copy with the unset fields filled for this model, data, device and precision, and
        the device checked (``self`` unchanged); its ``defaults`` is ``{field: "value (why)"}``
        for each filled field. Resolving a resolved config gives an equal one."""
        from grpo_nb.llm.placement import check_placement, dtype_of, ring_sync
        from grpo_nb.tasks import is_arithmetic_name
        from grpo_nb.tiny_model import is_tiny_model

        fill: dict[str, Any] = {}
        why: dict[str, str] = dict(self.defaults or {})

        def put(name: str, value: Any, reason: str) -> None:
            fill[name], why[name] = value, f"{value} ({reason})"

        if self.loss_agg is None:
            put("loss_agg", LOSS_TYPE_AGG.get(self.loss_type or "", "token-mean"),
                f"loss_type={self.loss_type!r}" if self.loss_type else
                "PPO-clip's token mean: TRL's dapo")
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = 8 if is_arithmetic_name(self.dataset) else 256
            put("max_tokens", max_tokens, f"for {self.dataset!r}: 8 for arithmetic, 256 for "
                "math text")
        if self.overlong == "soft" and self.overlong_buffer is None:
            put("overlong_buffer", max(1, max_tokens // 4), "max_tokens // 4, for overlong='soft'")
        if self.lr is None:
            tiny = is_tiny_model(self.model)
            put("lr", TINY_LR if tiny else PRETRAINED_LR, "the tiny character model" if tiny
                else "a pretrained model: Qwen-scale RL fine-tuning")
        if self.ratio_against == "auto":
            bf16 = dtype_of(self) == "bfloat16"
            put("ratio_against", "trainer" if bf16 or self.tis_cap is not None else "sampler",
                "bfloat16: trainer and server round differently, so the sampler's log-probs "
                "are not the trainer's even for fresh samples" if bf16 else "tis_cap is set"
                if self.tis_cap is not None else
                "float32 on both sides: the sampler's log-probs are the trainer's")
            if fill["ratio_against"] == "trainer" and self.tis_cap is None:
                put("tis_cap", MIXED_PRECISION_TIS_CAP, "with ratio_against='trainer'")
        if self.sync.pause_mode == "auto":
            given = {k: v for k, v in asdict(self.sync).items() if k != "pause_mode"}
            fill["sync"], why["sync.pause_mode"] = ring_sync(given, self)
        out = replace(self, **fill)
        check_placement(out)
        out.defaults = why
        return out

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
        """A checked copy with ``changes``; the fields :meth:`resolve` filled are unset again,
        and a resolved config's copy is resolved again (for its changed model, data or device)."""
        filled = self.defaults or {}
        unset: dict[str, Any] = {f.name: f.default for f in fields(self) if f.name in filled}
        if "sync.pause_mode" in filled:
            unset["sync"] = replace(self.sync, pause_mode="auto")
        out = replace(self, **{**unset, **changes})
        return out if self.defaults is None else out.resolve()
