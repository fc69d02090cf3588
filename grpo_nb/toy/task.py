"""The toy task: a random state is the prompt, the MLP policy picks one of ``arms``, and the
reward is 1 for the arm a hidden teacher ``W*`` prefers (``argmax W* s``): optimum 1, random ``1/arms``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import torch
from torch import nn

from grpo_nb.config import Ge, Lt, NonNegFloat, NonNegInt, PosFloat, PosInt, check_fields
from grpo_nb.grpo import (
    OBJECTIVE_FIELDS,
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
    """Everything the toy ring needs, each field checked against its annotation
    (:func:`grpo_nb.config.check_fields`; errors name the field). ``smoke()``: the CI size."""

    steps: PosInt = 400  # trainer steps
    generators: PosInt = 4  # generator actors, each sampling whole groups
    group_size: Annotated[int, Ge(2)] = 8  # G samples of the same state form one GRPO group
    groups_per_step: PosInt = 4  # groups per trainer step (batch B = groups_per_step x G)
    obs_dim: PosInt = 4  # size of a state (the "prompt")
    arms: Annotated[int, Ge(2)] = 4  # actions to choose from (random policy: reward 1/arms)
    hidden: PosInt = 32  # width of the MLP policy's hidden layer
    lr: PosFloat = 0.02  # Adam's learning rate
    clip: Annotated[float, Ge(0), Lt(1)] = 0.2  # PPO's clip, both bounds (and CISPO's cap)
    kl_coef: NonNegFloat = 0.02  # weight of the KL penalty to the reference policy
    kl_kind: KLKind = "k3"  # the KL estimator (grpo.kl_penalty)
    adv_scale: AdvScale = "std"  # "none": no division by the group's std (Dr. GRPO)
    # TRL GRPOConfig's names and meanings, as LLMConfig's (grpo.policy_loss; clip is both
    # bounds, and CISPO's cap on the weight r): loss_type None is PPO-clip; with one token per
    # sample every aggregation is the mean, and "sequence" (GSPO) equals "token".
    loss_type: LossType | None = None
    importance_sampling_level: ISLevel = "token"  # one ratio per token or per sequence
    off_policy_mask_threshold: float | None = None  # drop A < 0 samples drifted beyond it
    delta: float | None = None  # INTELLECT-2's cap on r for A < 0
    sapo_temperature_pos: float = SAPO_TEMPERATURE_POS  # SAPO's gate temperature for A > 0
    sapo_temperature_neg: float = SAPO_TEMPERATURE_NEG  # and for A <= 0
    # DAPO's dynamic sampling, as LLMConfig's (ring.DynamicSampling): a group whose rewards are
    # all equal is dropped and replaced, at most ring.DYNAMIC_DROP_CAP × groups_per_step a step.
    dynamic_sampling: bool = False
    seed: int = 0  # policy init, states and teacher
    gen_delay_s: NonNegFloat = 0.02  # simulated decode time per group (an MLP samples in µs)
    gen_delay_tail: NonNegFloat = 0.0  # sigma of its mean-1 log-normal tail (decode_time)
    train_delay_s: NonNegFloat = 0.0  # simulated time of a trainer step beyond its computation
    # Credits: "async" keeps 1 + max_ahead steps' worth of groups issued, "sync" one step's worth.
    mode: Literal["async", "sync"] = "async"
    max_ahead: NonNegInt = 2  # steps' worth of groups issued beyond the current one (async)
    eval_states: PosInt = 512  # held-out states the greedy policy is evaluated on
    # New weights go to ONE generator picked at random (as in Monarch's example), or to "all".
    selection: Literal["choose", "all"] = "choose"
    backend: Literal["asyncio", "monarch"] = "asyncio"  # actors in this process, or on Monarch
    # A process mesh per role (K + 3 processes on Monarch), or scorer, reference, trainer in one.
    layout: Literal["per_role", "shared"] = "per_role"
    optimum: ClassVar[float] = 1.0  # the expected reward of always picking the paying arm

    def __post_init__(self) -> None:
        check_fields(self)
        check_objective(**{k: getattr(self, k) for k in OBJECTIVE_FIELDS}, clip_high=self.clip,
                        prefix="ToyConfig.", clip_high_name="clip")

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


