"""The four actors of the toy GRPO ring, written once against an actor API module.

``actor_classes(api)`` builds them for ``grpo_nb.actors`` or ``monarch.actor``; nothing else
differs between the two runtimes::

    Generator x K ──Group──► Scorer ──Group+rewards──► Reference ──Group+ref_logps──► Trainer
         ▲            (shared port)                                                  │
         └───────── send(update_weights, (version, weights), selection="choose") ◄───┘
    every actor ──Event("busy" | "step" | "exited" | "error")──► controller (metrics port)

Each stage's loop is a background task started by a one-shot ``start`` endpoint (so the
actor's mailbox stays free for ``update_weights``, ``drain`` and ``stop``); ``__cleanup__``
cancels it. A loop that crashes reports its traceback to the controller, which raises it.
Shutdown: the trainer, after its last step, calls ``drain`` on every generator; each sends
a ``None`` sentinel; the scorer forwards one ``None`` after it has seen all of them, the
reference forwards it, the trainer discards what was still queued and reports "exited".
"""

from __future__ import annotations

import asyncio
import copy
import time
from functools import cache
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from grpo_nb import grpo
from grpo_nb.ring import Busy, Event, cancel_task, stage_base
from grpo_nb.toy import (
    Group,
    ToyConfig,
    best_arm,
    build_policy,
    build_teacher,
    policy_logprobs,
)


@cache
def actor_classes(api: ModuleType) -> SimpleNamespace:
    """``Generator``, ``Scorer``, ``Reference``, ``Trainer`` for the given actor API."""

    class _Stage(stage_base(api)):  # launch / guard / cleanup: grpo_nb.ring
        def _loop_ended(self) -> None:
            self.busy.flush()

    class Generator(_Stage):
        def __init__(self, cfg: ToyConfig, weights: dict, out: Any, metrics: Any) -> None:
            self.cfg, self.out, self.metrics = cfg, out, metrics
            self.policy = build_policy(cfg)
            self.policy.load_state_dict(weights)
            self.version = 0  # of the weights this generator samples with
            self.trainer_version = 0  # of the trainer's newest weights (broadcast to all)
            self.pending: tuple[int, dict] | None = None
            self.progressed = asyncio.Event()

        @api.endpoint
        async def start(self) -> None:
            rank = api.current_rank().rank
            self.name = f"gen{rank}"
            self.busy = Busy(self.name, self.metrics)
            self.rng = torch.Generator().manual_seed(self.cfg.seed * 1009 + 17 * rank + 1)
            self._launch(self._produce())

        def _apply_pending(self) -> None:
            if self.pending is not None:
                self.version, weights = self.pending
                self.policy.load_state_dict(weights)
                self.pending = None

        async def _produce(self) -> None:
            cfg, made = self.cfg, 0
            while True:
                self._apply_pending()
                if cfg.max_lag is not None:
                    # Flow control: this generator's share of the ring's output may run at most
                    # max_lag trainer steps ahead (assuming the K generators share the work).
                    while self.trainer_version < (made * cfg.generators) // cfg.groups_per_step - cfg.max_lag:
                        self.progressed.clear()
                        await self.progressed.wait()
                    self._apply_pending()
                start = time.time()
                obs = torch.randn(cfg.obs_dim, generator=self.rng)
                with torch.no_grad():
                    logp_all = torch.log_softmax(self.policy(obs), dim=-1)
                    acts = torch.multinomial(logp_all.exp(), cfg.group_size, replacement=True, generator=self.rng)
                # Stands for the time a real generator spends decoding (see ToyConfig.gen_delay_s).
                await asyncio.sleep(cfg.gen_delay_s)
                self.out.send(Group(obs, acts, logp_all[acts], self.version, self.name, time.time()))
                self.busy.add("generate", start)
                made += 1

        @api.endpoint
        async def update_weights(self, version: int, weights: dict) -> None:
            if self.pending is None or version > self.pending[0]:
                self.pending = (version, weights)  # only the newest matters

        @api.endpoint
        async def progress(self, version: int) -> None:
            self.trainer_version = max(self.trainer_version, version)
            self.progressed.set()

        @api.endpoint
        async def drain(self) -> None:
            await cancel_task(getattr(self, "_task", None))
            self.busy.flush()
            self.out.send(None)

    class Scorer(_Stage):
        name = "scorer"

        def __init__(self, cfg: ToyConfig, metrics: Any) -> None:
            self.cfg, self.metrics = cfg, metrics
            self.teacher = build_teacher(cfg)
            self.port, self.inbox = api.Channel.open()
            self.busy = Busy(self.name, metrics)

        @api.endpoint
        async def inlet(self) -> Any:
            return self.port

        @api.endpoint
        async def start(self, out: Any) -> None:
            self._launch(self._score(out))

        async def _score(self, out: Any) -> None:
            sentinels = 0
            while sentinels < self.cfg.generators:  # drained once every generator has stopped
                group = await self.inbox.recv()
                if group is None:
                    sentinels += 1
                    continue
                start = time.time()
                group.rewards = (group.actions == best_arm(self.teacher, group.obs)).float()
                out.send(group)
                self.busy.add("score", start)
            out.send(None)
            self.metrics.send(Event("exited", {"actor": self.name}))

    class Reference(_Stage):
        name = "reference"

        def __init__(self, cfg: ToyConfig, weights: dict, metrics: Any) -> None:
            self.cfg, self.metrics = cfg, metrics
            self.policy = build_policy(cfg)
            self.policy.load_state_dict(weights)
            self.policy.requires_grad_(False)
            self.port, self.inbox = api.Channel.open()
            self.busy = Busy(self.name, metrics)

        @api.endpoint
        async def inlet(self) -> Any:
            return self.port

        @api.endpoint
        async def start(self, out: Any) -> None:
            self._launch(self._annotate(out))

        async def _annotate(self, out: Any) -> None:
            while (group := await self.inbox.recv()) is not None:
                start = time.time()
                with torch.no_grad():
                    group.ref_logprobs = policy_logprobs(self.policy, group.obs, group.actions)
                out.send(group)
                self.busy.add("ref logp", start)
            out.send(None)
            self.metrics.send(Event("exited", {"actor": self.name}))

    class Trainer(_Stage):
        name = "trainer"

        def __init__(self, cfg: ToyConfig, metrics: Any) -> None:
            self.cfg, self.metrics = cfg, metrics
            torch.manual_seed(cfg.seed)
            self.policy = build_policy(cfg)
            self.opt = torch.optim.Adam(self.policy.parameters(), lr=cfg.lr)
            self.teacher = build_teacher(cfg)
            eval_gen = torch.Generator().manual_seed(cfg.seed + 4242)
            self.eval_obs = torch.randn(cfg.eval_states, cfg.obs_dim, generator=eval_gen)
            self.eval_best = best_arm(self.teacher, self.eval_obs)
            self.port, self.inbox = api.Channel.open()
            self.busy = Busy(self.name, metrics)

        @api.endpoint
        async def inlet(self) -> Any:
            return self.port

        @api.endpoint
        async def snapshot(self) -> dict:
            return copy.deepcopy(self.policy.state_dict())

        @api.endpoint
        async def start(self, generators: Any) -> None:
            self._launch(self._train(generators))

        def _expected_reward(self) -> float:
            """Exact expected reward of the current policy, averaged over fixed eval states."""
            with torch.no_grad():
                probs = torch.softmax(self.policy(self.eval_obs), dim=-1)
                return float(probs.gather(1, self.eval_best[:, None]).mean())

        async def _train(self, generators: Any) -> None:
            cfg = self.cfg
            for step in range(cfg.steps):
                groups: list[Group] = []
                while len(groups) < cfg.groups_per_step:
                    groups.append(await self.inbox.recv())
                depth = self.inbox.qsize() if hasattr(self.inbox, "qsize") else None
                start = time.time()
                row = self._step(step, groups)
                # Fresh weights to ONE generator (load balancing, as in Monarch's example); the
                # version number to all (a few bytes), which paces them (ToyConfig.max_lag).
                api.send(generators.update_weights, (step + 1, copy.deepcopy(self.policy.state_dict())), {}, selection="choose")
                api.send(generators.progress, (step + 1,), {}, selection="all")
                self.busy.add("train", start)
                self.metrics.send(Event("step", {**row, "queue_depth": depth}))
                await asyncio.sleep(0)  # let update_weights / metrics go out between steps
            await generators.drain.call()
            dropped = 0
            while await self.inbox.recv() is not None:
                dropped += 1  # produced but never trained on: the price of running ahead
            self.metrics.send(Event("exited", {"actor": self.name, "dropped": dropped}))

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
            return {
                "step": step + 1,
                "reward": float(rewards.mean()),
                "expected_reward": self._expected_reward(),
                "loss": m["loss"],
                "kl": m["kl"],
                "clip_frac": m["clip_frac_low"] + m["clip_frac_high"],
                "ratio_mean": m["ratio_mean"],
                "zero_std_groups": grpo.zero_std_groups(rewards, cfg.group_size),
                "staleness": [step - g.version for g in groups],
                "sources": [g.source for g in groups],
                "age_s": [time.time() - g.created for g in groups],
            }

    return SimpleNamespace(Generator=Generator, Scorer=Scorer, Reference=Reference, Trainer=Trainer)
