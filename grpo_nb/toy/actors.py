"""The four actors of the toy GRPO ring, on the shared skeleton of :mod:`grpo_nb.ring`::

    Generator × K ──Group──► Scorer ──Group + rewards──► Reference ──Group + ref_logprobs──► Trainer
      (Source)      (one shared inlet)  (Relay)                  (Relay)                    (Sink)
         ▲                                                                                  │
         └──── send(update_weights, (version, weights), selection="choose") ◄───────────────┘
               send(progress, (version,), selection="all")
    every actor ──Event("busy" | "step" | "exited" | "error")──► Controller (metrics port)

What is specific to the toy ring is only what each stage does to a :class:`~grpo_nb.toy.task.Group`:
the generator samples ``G`` arms from its MLP, the scorer asks the hidden teacher which arm
pays, the reference adds its log-probs (for the KL term), the trainer takes a GRPO step and
sends its new weights to ONE generator, chosen at random (load balancing, as in Monarch's own
example; ``ToyConfig.selection="all"`` broadcasts them instead), and its version number to all
(a few bytes, which paces them: ``ToyConfig.max_lag``).

These are plain module-level classes: the same classes run on torchmonarch processes.
"""

from __future__ import annotations

import asyncio
import copy
import math
import time
from typing import Any

import torch

from grpo_nb import grpo
from grpo_nb.actors import current_rank, endpoint, send
from grpo_nb.ring import Relay, Sink, Source
from grpo_nb.toy.task import (
    Group,
    ToyConfig,
    best_arm,
    build_policy,
    build_teacher,
    policy_logprobs,
)


class Generator(Source):
    """Samples groups from its copy of the policy; loads new weights when the trainer sends some."""

    def __init__(self, cfg: ToyConfig, weights: dict, out: Any, metrics: Any) -> None:
        self.cfg, self.out = cfg, out
        self.policy = build_policy(cfg)
        self.policy.load_state_dict(weights)
        self.version = 0  # of the weights this generator samples with
        self.trainer_version = 0  # of the trainer's newest weights (broadcast to all)
        self.pending: tuple[int, dict] | None = None
        self.progressed = asyncio.Event()
        self.attach(metrics)

    @endpoint
    async def start(self) -> None:
        rank = current_rank().rank
        self.attach(self.metrics, f"gen{rank}")
        self.rng = torch.Generator().manual_seed(self.cfg.seed * 1009 + 17 * rank + 1)
        self.launch(self._produce())

    @endpoint
    async def update_weights(self, version: int, weights: dict) -> None:
        if self.pending is None or version > self.pending[0]:
            self.pending = (version, weights)  # only the newest matters

    @endpoint
    async def progress(self, version: int) -> None:
        self.trainer_version = max(self.trainer_version, version)
        self.progressed.set()

    def _apply_pending(self) -> None:
        if self.pending is not None:
            self.version, weights = self.pending
            self.policy.load_state_dict(weights)
            self.pending = None

    async def _wait_for_trainer(self, made: int) -> None:
        """Flow control: this generator's share of the ring's output may run at most
        ``max_lag`` trainer steps ahead (assuming the K generators share the work)."""
        cfg = self.cfg
        if cfg.max_lag is None:
            return
        while self.trainer_version < (made * cfg.generators) // cfg.groups_per_step - cfg.max_lag:
            self.progressed.clear()
            await self.progressed.wait()

    def _decode_time(self) -> float:
        """``gen_delay_s``, times a log-normal factor of mean 1 when the tail is on."""
        sigma = self.cfg.gen_delay_tail
        if sigma == 0:
            return self.cfg.gen_delay_s
        z = float(torch.randn((), generator=self.rng))
        return self.cfg.gen_delay_s * math.exp(sigma * z - sigma * sigma / 2)

    async def _produce(self) -> None:
        made = 0
        while True:
            self._apply_pending()
            await self._wait_for_trainer(made)
            self._apply_pending()
            start = time.time()
            obs = torch.randn(self.cfg.obs_dim, generator=self.rng)
            with torch.no_grad():
                logp_all = torch.log_softmax(self.policy(obs), dim=-1)
                acts = torch.multinomial(logp_all.exp(), self.cfg.group_size, replacement=True,
                                         generator=self.rng)
            # Stands for the time a real generator spends decoding (see ToyConfig.gen_delay_s).
            await asyncio.sleep(self._decode_time())
            self.out.send(Group(obs, acts, logp_all[acts], self.version, self.name, time.time()))
            self.busy.add("generate", start)
            made += 1


class Scorer(Relay):
    """Rewards each sample 1 when it picked the arm the hidden teacher prefers."""

    name, label, sender = "scorer", "score", "the generators"

    def __init__(self, cfg: ToyConfig, metrics: Any) -> None:
        self.upstream = cfg.generators  # every generator ends its stream with one None
        self.teacher = build_teacher(cfg)
        self.open_inlet()
        self.attach(metrics)

    async def process(self, group: Group) -> Group:
        group.rewards = (group.actions == best_arm(self.teacher, group.obs)).float()
        return group


class Reference(Relay):
    """Adds the frozen initial policy's log-probs, which the KL penalty compares against."""

    name, label, sender = "reference", "ref logp", "scorer"

    def __init__(self, cfg: ToyConfig, weights: dict, metrics: Any) -> None:
        self.policy = build_policy(cfg)
        self.policy.load_state_dict(weights)
        self.policy.requires_grad_(False)
        self.open_inlet()
        self.attach(metrics)

    async def process(self, group: Group) -> Group:
        with torch.no_grad():
            group.ref_logprobs = policy_logprobs(self.policy, group.obs, group.actions)
        return group


class Trainer(Sink):
    """Takes ``groups_per_step`` groups per step, one GRPO update, then new weights out."""

    name, sender = "trainer", "reference"

    def __init__(self, cfg: ToyConfig, metrics: Any) -> None:
        self.cfg = cfg
        self.policy = build_policy(cfg, seed=cfg.seed)
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=cfg.lr)
        self.teacher = build_teacher(cfg)
        eval_gen = torch.Generator().manual_seed(cfg.seed + 4242)
        self.eval_obs = torch.randn(cfg.eval_states, cfg.obs_dim, generator=eval_gen)
        self.eval_best = best_arm(self.teacher, self.eval_obs)
        self.open_inlet()
        self.attach(metrics)

    @endpoint
    async def snapshot(self) -> dict:
        return copy.deepcopy(self.policy.state_dict())

    @endpoint
    async def start(self, generators: Any) -> None:
        self.launch(self._train(generators))

    async def _train(self, generators: Any) -> None:
        cfg = self.cfg
        for step in range(cfg.steps):
            groups = [await self.inbox.recv() for _ in range(cfg.groups_per_step)]
            depth = self.inbox.qsize() if hasattr(self.inbox, "qsize") else None  # not on Monarch
            start = time.time()
            row = self._step(step, groups)
            if cfg.train_delay_s:
                await asyncio.sleep(cfg.train_delay_s)  # see ToyConfig.train_delay_s
            send(generators.update_weights, (step + 1, copy.deepcopy(self.policy.state_dict())), {},
                 selection=cfg.selection)
            send(generators.progress, (step + 1,), {}, selection="all")
            self.busy.add("train", start)
            self.report("step", **row, queue_depth=depth)
            await asyncio.sleep(0)  # let update_weights / metrics go out between steps
        # Bounded (Sink.finish_timeout_s): a generator or stage that died is named, not waited on.
        await self.drain_sources(generators, cfg.generators)
        self.report("exited", actor=self.name, dropped=await self.discard_queued())

    def _evaluate(self) -> tuple[float, float]:
        """The current policy's exact expected reward and its mean entropy (nats), both
        averaged over the fixed eval states: exact, so the curves are not sampling noise."""
        with torch.no_grad():
            logits = self.policy(self.eval_obs)
            probs = torch.softmax(logits, dim=-1)
            entropy = grpo.masked_entropy(logits[:, None], torch.ones(len(logits), 1))
            return float(probs.gather(1, self.eval_best[:, None]).mean()), entropy

    def _step(self, step: int, groups: list[Group]) -> dict[str, Any]:
        cfg = self.cfg
        obs = torch.stack([g.obs for g in groups])
        acts = torch.stack([g.actions for g in groups])  # [n, G]
        old = torch.cat([g.logprobs for g in groups])[:, None]  # [B, 1]
        ref = torch.cat([g.ref_logprobs for g in groups])[:, None]
        rewards = torch.cat([g.rewards for g in groups])  # [B]
        logp = policy_logprobs(self.policy, obs, acts).reshape(-1, 1)
        adv = grpo.group_advantages(rewards, cfg.group_size)
        loss, m = grpo.policy_loss(
            logp, old, adv, torch.ones_like(logp), clip_low=cfg.clip, clip_high=cfg.clip,
            ref_logprobs=ref, kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind,
        )
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        expected_reward, entropy = self._evaluate()
        return {
            "step": step + 1,
            "reward": float(rewards.mean()),
            "expected_reward": expected_reward,
            "entropy": entropy,
            "loss": m["loss"],
            "kl": m["kl"],
            "clip_frac": m["clip_frac_low"] + m["clip_frac_high"],
            "ratio_mean": m["ratio_mean"],
            "zero_std_groups": grpo.zero_std_groups(rewards, cfg.group_size),
            "zero_std_frac": grpo.zero_std_fraction(rewards, cfg.group_size),
            "staleness": [step - g.version for g in groups],
            "sources": [g.source for g in groups],
            "age_s": [time.time() - g.created for g in groups],
        }

