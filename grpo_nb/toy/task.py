"""The toy task: a random state is the prompt, the MLP policy picks one of ``arms``, and the
reward is 1 for the arm a hidden teacher ``W*`` prefers (``argmax W* s``): optimum 1, random ``1/arms``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from grpo_nb.grpo import (
    ADV_SCALES,
    KL_KINDS,
    SAPO_TEMPERATURE_NEG,
    SAPO_TEMPERATURE_POS,
    AdvScale,
    ISLevel,
    KLKind,
    LossType,
    check_objective,
)


@dataclass(frozen=True)
class ToyConfig:
    """Everything the toy ring needs (validated; errors name the field). ``smoke()``: the CI size."""

    steps: int = 400
    generators: int = 4
    group_size: int = 8  # G samples of the same state form one GRPO group
    groups_per_step: int = 4  # groups per trainer step (batch B = groups_per_step x G)
    obs_dim: int = 4
    arms: int = 4
    hidden: int = 32
    lr: float = 0.02
    clip: float = 0.2
    kl_coef: float = 0.02
    kl_kind: KLKind = "k3"
    adv_scale: AdvScale = "std"  # "none": no division by the group's std (Dr. GRPO)
    # TRL GRPOConfig's names and meanings, as LLMConfig's (grpo.policy_loss; clip is both
    # bounds, and CISPO's cap on the weight r): loss_type None is PPO-clip; with one token per
    # sample every aggregation is the mean, and "sequence" (GSPO) equals "token".
    loss_type: LossType | None = None
    importance_sampling_level: ISLevel = "token"
    off_policy_mask_threshold: float | None = None  # drop A < 0 samples drifted beyond it
    delta: float | None = None  # INTELLECT-2's cap on r for A < 0
    sapo_temperature_pos: float = SAPO_TEMPERATURE_POS  # SAPO's gate temperature for A > 0
    sapo_temperature_neg: float = SAPO_TEMPERATURE_NEG  # and for A <= 0
    # DAPO's dynamic sampling, as LLMConfig's (ring.DynamicSampling): a group whose rewards are
    # all equal is dropped and replaced, at most ring.DYNAMIC_DROP_CAP × groups_per_step a step.
    dynamic_sampling: bool = False
    seed: int = 0
    # Simulated decode time per group (an MLP samples in microseconds) and its log-normal tail.
    gen_delay_s: float = 0.02
    gen_delay_tail: float = 0.0
    # Simulated time of a trainer step beyond its tiny computation.
    train_delay_s: float = 0.0
    # Credits: "async" keeps 1 + max_ahead steps' worth of groups issued, "sync" one step's worth.
    mode: Literal["async", "sync"] = "async"
    max_ahead: int = 2
    eval_states: int = 512
    # New weights go to ONE generator picked at random (as in Monarch's example), or to "all".
    selection: Literal["choose", "all"] = "choose"
    backend: Literal["asyncio", "monarch"] = "asyncio"
    # A process mesh per role (K + 3 processes on Monarch), or scorer, reference, trainer in one.
    layout: Literal["per_role", "shared"] = "per_role"
    optimum: ClassVar[float] = 1.0  # the expected reward of always picking the paying arm

    def __post_init__(self) -> None:
        lows = {**dict.fromkeys(("steps", "generators", "groups_per_step", "obs_dim", "hidden",
                                 "eval_states"), 1), "group_size": 2, "arms": 2,
                **dict.fromkeys(("kl_coef", "gen_delay_s", "gen_delay_tail", "train_delay_s",
                                 "max_ahead"), 0)}
        for name, low in lows.items():
            if getattr(self, name) < low:
                raise ValueError(f"ToyConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"ToyConfig.lr must be a positive number, got {self.lr}")
        if not isinstance(self.dynamic_sampling, bool):
            raise ValueError(f"ToyConfig.dynamic_sampling must be True or False, got "
                             f"{self.dynamic_sampling!r}")
        if not 0 <= self.clip < 1:
            raise ValueError(f"ToyConfig.clip must be in [0, 1), got {self.clip}")
        for name, allowed in (("kl_kind", KL_KINDS), ("adv_scale", ADV_SCALES),
                              ("mode", ("async", "sync")), ("selection", ("choose", "all")),
                              ("backend", ("asyncio", "monarch")), ("layout", ("per_role", "shared"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ToyConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        check_objective(loss_type=self.loss_type,
                        importance_sampling_level=self.importance_sampling_level,
                        off_policy_mask_threshold=self.off_policy_mask_threshold,
                        delta=self.delta, clip_high=self.clip,
                        sapo_temperature_pos=self.sapo_temperature_pos,
                        sapo_temperature_neg=self.sapo_temperature_neg, prefix="ToyConfig.",
                        clip_high_name="clip")

    @classmethod
    def smoke(cls) -> ToyConfig:
        """A few seconds, long enough to watch it learn live."""
        return cls(steps=100, gen_delay_s=0.03)

    @property
    def random_reward(self) -> float:
        """Expected reward of the uniform policy."""
        return 1.0 / self.arms


@dataclass
class Group:
    """One GRPO group travelling around the ring; each stage fills in its field."""

    obs: torch.Tensor  # [obs_dim] the shared "prompt"
    actions: torch.Tensor  # [G] long
    logprobs: torch.Tensor  # [G] under the generating policy
    version: int  # weights version of that policy (staleness = trainer version - version)
    source: str  # which generator
    created: float  # wall-clock time.time() when sent
    rewards: torch.Tensor | None = None  # [G] filled by the scorer
    advantages: torch.Tensor | None = None  # [G] filled by the scorer (grpo.group_advantages)
    ref_logprobs: torch.Tensor | None = None  # [G] filled by the reference


def build_policy(cfg: ToyConfig, seed: int | None = None) -> nn.Module:
    """The MLP policy; with ``seed``, drawn from that seed only (the global RNG left alone)."""
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(cfg.obs_dim, cfg.hidden), nn.Tanh(),
                             nn.Linear(cfg.hidden, cfg.arms))


def decode_time(cfg: ToyConfig, z: float) -> float:
    """``gen_delay_s`` times a mean-1 log-normal factor (sigma ``gen_delay_tail``) of draw ``z``."""
    sigma = cfg.gen_delay_tail
    return cfg.gen_delay_s * math.exp(sigma * z - sigma * sigma / 2)


def build_teacher(cfg: ToyConfig) -> torch.Tensor:
    """The hidden ``W*`` [arms, obs_dim]: the same for every actor that builds it from cfg."""
    gen = torch.Generator().manual_seed(10_007 + cfg.seed)
    return torch.randn(cfg.arms, cfg.obs_dim, generator=gen)


def best_arm(teacher: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
    """The paying arm for each state: ``argmax W* s`` (works for [obs_dim] and [N, obs_dim])."""
    return (obs @ teacher.T).argmax(dim=-1, keepdim=obs.dim() == 1)


def policy_logprobs(policy: nn.Module, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """log π(a|s) for actions [..., G] taken in states [..., obs_dim] (one state per group)."""
    return torch.log_softmax(policy(obs), dim=-1).gather(-1, actions)


