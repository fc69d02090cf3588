"""The toy task and policy: a contextual bandit with a known optimum, and an MLP that learns it.

A random state ``s ∈ R^obs_dim`` is the prompt; the policy picks one of ``arms`` actions; the
reward is 1 for the arm a fixed hidden teacher ``W*`` prefers (``argmax W* s``), else 0. A random
policy earns ``1/arms``, the best exactly 1.0, so a plot shows the gap to a known optimum.
:class:`Group` is the ring's one message: each stage fills in its field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from grpo_nb.grpo import AdvScale


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
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    adv_scale: AdvScale = "std"  # "none": no division by the group's std (Dr. GRPO)
    seed: int = 0
    # Simulated decoding time per group: sampling from a tiny MLP takes microseconds, unlike
    # an LLM. gen_delay_tail > 0 multiplies it by a log-normal factor of mean 1 and that sigma
    # (1.5: one group in a hundred takes over 10x the mean, like an answer that runs to max_tokens).
    gen_delay_s: float = 0.02
    gen_delay_tail: float = 0.0
    # Simulated time of a trainer step beyond its tiny computation (a backward pass elsewhere).
    train_delay_s: float = 0.0
    # Credits, as in the LLM ring: the trainer issues them and generator r of K makes its share.
    # "async" keeps 1 + max_ahead steps' worth outstanding; "sync" issues one step's worth only
    # after each update (with weights to every generator: on-policy).
    mode: Literal["async", "sync"] = "async"
    max_ahead: int = 2
    eval_states: int = 512
    # Who gets the trainer's new weights: "choose" sends them to ONE generator picked at random
    # (cheap, as in Monarch's example; the others keep sampling with older weights); "all" to all.
    selection: Literal["choose", "all"] = "choose"
    backend: Literal["asyncio", "monarch"] = "asyncio"
    # "per_role": a process mesh per role (K + 3 processes on Monarch, as in Monarch's example);
    # "shared": scorer, reference and trainer share one process (K + 1: faster to start).
    layout: Literal["per_role", "shared"] = "per_role"

    def __post_init__(self) -> None:
        for name in ("steps", "generators", "group_size", "groups_per_step", "obs_dim", "hidden", "eval_states"):
            if getattr(self, name) < 1:
                raise ValueError(f"ToyConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"ToyConfig.group_size must be >= 2 (a group needs a spread), got {self.group_size}")
        if self.arms < 2:
            raise ValueError(f"ToyConfig.arms must be >= 2, got {self.arms}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"ToyConfig.lr must be a positive number, got {self.lr}")
        if not 0 <= self.clip < 1:
            raise ValueError(f"ToyConfig.clip must be in [0, 1), got {self.clip}")
        for name in ("kl_coef", "gen_delay_s", "gen_delay_tail", "train_delay_s", "max_ahead"):
            if getattr(self, name) < 0:
                raise ValueError(f"ToyConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name, allowed in (("kl_kind", ("k1", "k2", "k3")), ("adv_scale", ("std", "none")),
                              ("mode", ("async", "sync")), ("selection", ("choose", "all")),
                              ("backend", ("asyncio", "monarch")), ("layout", ("per_role", "shared"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ToyConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    @classmethod
    def smoke(cls) -> ToyConfig:
        """Small enough for CI (a few seconds), large enough to learn visibly; gen_delay_s keeps
        the notebook's live run going for a few seconds even on fast CPUs."""
        return cls(steps=100, gen_delay_s=0.03)

    @property
    def optimum(self) -> float:
        """Best achievable expected reward: always picking the teacher's arm pays 1."""
        return 1.0

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
    """The MLP policy; with ``seed``, its initial weights are drawn from that seed only (the
    process's global random state is left as it was)."""
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(cfg.obs_dim, cfg.hidden), nn.Tanh(),
                             nn.Linear(cfg.hidden, cfg.arms))


def decode_time(cfg: ToyConfig, z: float) -> float:
    """A group's simulated decode time for a standard normal draw ``z``: ``gen_delay_s`` times a
    log-normal factor of mean 1 whose sigma is ``gen_delay_tail``."""
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
    logp_all = torch.log_softmax(policy(obs), dim=-1)
    return logp_all.gather(-1, actions)


