"""The toy GRPO ring's four stages on :mod:`grpo_nb.ring`'s skeleton; each hop carries one
:class:`~grpo_nb.toy.task.Group`.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import torch

from grpo_nb import grpo
from grpo_nb.actors import endpoint, send
from grpo_nb.ring import Relay, Sink, Source
from grpo_nb.ring_core import Admit, Ledger, staleness
from grpo_nb.toy.task import (
    Group,
    ToyConfig,
    best_arm,
    build_policy,
    build_teacher,
    decode_time,
    policy_logprobs,
)


class Generator(Source):
    """Samples groups from its copy of the policy, as many as the trainer's credits allow."""

    def __init__(self, cfg: ToyConfig, weights: dict, out: Any, metrics: Any) -> None:
        self.cfg, self.out = cfg, out
        self.open_credits(cfg.generators, metrics)
        self.rng = torch.Generator().manual_seed(cfg.seed * 1009 + 17 * self.rank + 1)
        self.policy = build_policy(cfg)
        self.policy.load_state_dict(weights)
        self.version = 0  # of the weights it samples with
        self.pending: tuple[int, dict] | None = None

    @endpoint
    async def start(self) -> None:
        self.launch(self._produce())

    @endpoint
    async def update_weights(self, version: int, weights: dict) -> None:
        self.pending = (version, weights)  # in order from the trainer: only the newest matters

    async def _produce(self) -> None:
        while True:
            await self.credit()
            if self.pending is not None:  # weights arrive before the credits they come with
                self.version, weights = self.pending
                self.policy.load_state_dict(weights)
                self.pending = None
            start = time.time()
            obs = torch.randn(self.cfg.obs_dim, generator=self.rng)
            with torch.no_grad():
                logp_all = torch.log_softmax(self.policy(obs), dim=-1)
                acts = torch.multinomial(logp_all.exp(), self.cfg.group_size, replacement=True,
                                         generator=self.rng)
            z = float(torch.randn((), generator=self.rng)) if self.cfg.gen_delay_tail else 0.0
            await asyncio.sleep(decode_time(self.cfg, z))  # stands for an LLM's decoding time
            self.out.send(Group(obs, acts, logp_all[acts], self.version, self.name, time.time()))
            self.busy.add("generate", start)


class Scorer(Relay):
    """Rewards each sample 1 when it picked the teacher's arm; then the group's advantages."""

    name, label, sender = "scorer", "score", "the generators"

    def __init__(self, cfg: ToyConfig, metrics: Any) -> None:
        self.cfg = cfg
        self.upstream = cfg.generators  # every generator ends its stream with one None
        self.teacher = build_teacher(cfg)
        self.open_inlet(metrics)

    async def process(self, group: Group) -> Group:
        group.rewards = (group.actions == best_arm(self.teacher, group.obs)).float()
        group.advantages = grpo.group_advantages(group.rewards, self.cfg.group_size,
                                                 scale=self.cfg.adv_scale)
        return group


class Reference(Relay):
    """Adds the frozen initial policy's log-probs, which the KL penalty compares against."""

    name, label, sender = "reference", "ref logp", "scorer"

    def __init__(self, cfg: ToyConfig, weights: dict, metrics: Any) -> None:
        self.policy = build_policy(cfg)
        self.policy.load_state_dict(weights)
        self.policy.requires_grad_(False)
        self.open_inlet(metrics)

    async def process(self, group: Group) -> Group:
        with torch.no_grad():
            group.ref_logprobs = policy_logprobs(self.policy, group.obs, group.actions)
        return group


class Trainer(Sink):
    """Takes ``groups_per_step`` groups per step (with ``dynamic_sampling``, ones whose rewards
    differ: :class:`~grpo_nb.ring_core.Ledger`), one GRPO update, then new weights and credits
    out. ``admit`` is refused: the toy ring has no staleness bound and admits every group."""

    name, sender = "trainer", "reference"

    def __init__(self, cfg: ToyConfig, metrics: Any, admit: Admit | None = None) -> None:
        self.cfg = cfg
        self.policy = build_policy(cfg, seed=cfg.seed)
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=cfg.lr)
        eval_gen = torch.Generator().manual_seed(cfg.seed + 4242)
        self.eval_obs = torch.randn(cfg.eval_states, cfg.obs_dim, generator=eval_gen)
        self.eval_best = best_arm(build_teacher(cfg), self.eval_obs)
        self.open_inlet(metrics)
        self.ledger = Ledger(cfg.mode, cfg.max_ahead, cfg.groups_per_step,
                             dynamic_sampling=cfg.dynamic_sampling, admit=admit,
                             report=self.report)

    @endpoint
    async def start(self, generators: Any) -> None:
        self.launch(self._train(generators))

    async def _train(self, generators: Any) -> None:
        cfg, ledger = self.cfg, self.ledger
        ledger.open(generators, 0)
        for step in range(cfg.steps):
            ledger.dynamic.new_step()
            groups = await self.collect(
                cfg.groups_per_step, lambda g, step=step: ledger.take(step, g.version, g.rewards))
            if groups is None:  # the stream ended: only a drain sends its end
                break
            depth = self.inbox.qsize() if hasattr(self.inbox, "qsize") else None  # not on Monarch
            start = time.time()
            row = self._step(step, groups)
            if cfg.train_delay_s:
                await asyncio.sleep(cfg.train_delay_s)  # see ToyConfig.train_delay_s
            send(generators.update_weights, (step + 1, copy.deepcopy(self.policy.state_dict())), {},
                 selection=cfg.selection)
            ledger.refill(step + 1)  # after the weights: they arrive before their credits
            self.busy.add("train", start)
            self.report("step", **row, **ledger.dynamic.row(), queue_depth=depth)
            await asyncio.sleep(0)  # let update_weights / metrics go out between steps
        await self.drain_sources(generators, cfg.generators)
        self.report("exited", actor=self.name, dropped=await self.discard_queued())

    def _step(self, step: int, groups: list[Group]) -> dict[str, Any]:
        cfg = self.cfg
        obs = torch.stack([g.obs for g in groups])
        acts = torch.stack([g.actions for g in groups])  # [n, G]
        old = torch.cat([g.logprobs for g in groups])[:, None]  # [B, 1]
        ref = torch.cat([g.ref_logprobs for g in groups])[:, None]
        rewards = torch.cat([g.rewards for g in groups])  # [B]
        adv = torch.cat([g.advantages for g in groups])
        logp = policy_logprobs(self.policy, obs, acts).reshape(-1, 1)
        loss, m = grpo.policy_loss(
            logp, old, adv, torch.ones_like(logp), clip_low=cfg.clip, clip_high=cfg.clip,
            ref_logprobs=ref, kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind, max_tokens=1,
            **{k: getattr(cfg, k) for k in grpo.OBJECTIVE_FIELDS},
        )
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        with torch.no_grad():  # exact expected reward and mean entropy (nats) on the eval states
            logits = self.policy(self.eval_obs)
            probs = torch.softmax(logits, dim=-1)
        return {
            "step": step + 1,
            "reward": float(rewards.mean()),
            "expected_reward": float(probs.gather(1, self.eval_best[:, None]).mean()),
            "entropy": grpo.masked_entropy(logits[:, None], torch.ones(len(logits), 1)),
            "loss": m["loss"],
            "kl": m["kl"],
            "clip_frac": m["clip_frac_low"] + m["clip_frac_high"],
            "ratio_mean": m["ratio_mean"],
            **{k: m[k] for k in ("cispo_clip_frac", "delta_clip_frac", "off_policy_masked_frac")},
            "zero_std_groups": grpo.zero_std_groups(rewards, cfg.group_size),
            "zero_std_frac": grpo.zero_std_fraction(rewards, cfg.group_size),
            "staleness": [staleness(step, g.version) for g in groups],
            "sources": [g.source for g in groups],
            "age_s": [time.time() - g.created for g in groups],
        }

