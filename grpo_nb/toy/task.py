"""The toy task and policy: a contextual bandit with a known optimum, and an MLP that learns it.

A state ``s ∈ R^obs_dim`` is drawn at random; the policy picks one of ``arms`` actions; the
reward is 1 when it picks the arm a fixed hidden *teacher* ``W*`` prefers (``argmax W* s``),
else 0. A random policy earns ``1/arms``; the best policy earns exactly **1.0** (the teacher is
linear, the policy an MLP that can represent it), so a plot shows the gap to a known optimum
closing. This is the stand-in for "answer the prompt correctly" that the LLM ring
(:mod:`grpo_nb.llm`) replaces with a language model and a verifiable reward.

:class:`Group` is the one message of the toy ring: each stage fills in its field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Backend = Literal["asyncio", "monarch"]


@dataclass(frozen=True)
class ToyConfig:
    """Everything the toy ring needs. ``ToyConfig.smoke()`` is the CI size."""

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
    seed: int = 0
    # Simulated decoding time per group. Without it the generators would flood the trainer
    # (sampling 8 actions from a tiny MLP takes microseconds, unlike an LLM).
    gen_delay_s: float = 0.02
    # Heavy tail of that time: each group's delay is gen_delay_s x a log-normal factor of mean 1
    # and this sigma (0: every group takes gen_delay_s; 1.5: one group in a hundred takes over
    # 10x the mean, like an LLM answer that runs to max_tokens).
    gen_delay_tail: float = 0.0
    # Simulated time of one trainer step beyond its real (tiny) computation: a backward pass on
    # another device, during which generation goes on.
    train_delay_s: float = 0.0
    # Flow control. k: a generator waits before its n-th group until the trainer has reached
    # version n * generators // groups_per_step - k (its share of the work may run k steps
    # ahead). None: no pacing at all (the queue grows without bound when generators are faster
    # than the trainer). With one generator, 0 is on-policy and deterministic.
    max_lag: int | None = 2
    eval_states: int = 512
    # Who gets the trainer's new weights: "choose" sends them to ONE generator picked at random
    # (as in Monarch's example: cheap, but the others keep sampling with older weights);
    # "all" broadcasts them (every generator is at most max_lag steps behind).
    selection: Literal["choose", "all"] = "choose"
    backend: Backend = "asyncio"
    # "per_role": a process mesh per role (K + 3 processes on Monarch, as in Monarch's example);
    # "shared": generators on one mesh, scorer + reference + trainer share one process (K + 1).
    # Starting a process costs seconds (Python + torch imports), so "shared" starts faster.
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
        if self.kl_coef < 0:
            raise ValueError(f"ToyConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise ValueError(f"ToyConfig.kl_kind must be k1, k2 or k3, got {self.kl_kind!r}")
        if self.gen_delay_s < 0:
            raise ValueError(f"ToyConfig.gen_delay_s must be >= 0, got {self.gen_delay_s}")
        if self.gen_delay_tail < 0:
            raise ValueError(f"ToyConfig.gen_delay_tail must be >= 0, got {self.gen_delay_tail}")
        if self.train_delay_s < 0:
            raise ValueError(f"ToyConfig.train_delay_s must be >= 0, got {self.train_delay_s}")
        if self.max_lag is not None and self.max_lag < 0:
            raise ValueError(f"ToyConfig.max_lag must be None or >= 0, got {self.max_lag}")
        if self.selection not in ("choose", "all"):
            raise ValueError(f"ToyConfig.selection must be 'choose' or 'all', got {self.selection!r}")
        if self.layout not in ("per_role", "shared"):
            raise ValueError(f"ToyConfig.layout must be 'per_role' or 'shared', got {self.layout!r}")
        if self.backend not in ("asyncio", "monarch"):
            raise ValueError(f"ToyConfig.backend must be 'asyncio' or 'monarch', got {self.backend!r}")

    @classmethod
    def smoke(cls) -> ToyConfig:
        """Small enough for CI (a few seconds), large enough to learn visibly."""
        # gen_delay_s keeps the notebook's live run going for a few seconds even on fast CPUs.
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
    ref_logprobs: torch.Tensor | None = None  # [G] filled by the reference


def build_policy(cfg: ToyConfig, seed: int | None = None) -> nn.Module:
    """The MLP policy; with ``seed``, its initial weights are drawn from that seed only (the
    process's global random state is left as it was)."""
    if seed is None:
        return _mlp(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _mlp(cfg)


def _mlp(cfg: ToyConfig) -> nn.Module:
    return nn.Sequential(nn.Linear(cfg.obs_dim, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, cfg.arms))


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


