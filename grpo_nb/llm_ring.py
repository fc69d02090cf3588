"""The LLM GRPO ring: the toy ring's actors, now driving a Qwen model served by vLLM.

``actor_classes(api)`` builds the four actors for :mod:`grpo_nb.actors` (or ``monarch.actor``)::

    Generator × K ──ScoredGroup──► Scorer ──+rewards, advantages──► Reference ──+ref logp──► Trainer
      │  (≤ max_inflight sequences in flight each,                 (skipped when     │ staleness
      │   /v1/completions with token ids + logprobs)                kl_coef == 0)     │ admission
      ▲                                                                               ▼
      └──── progress(step, version, issued) to all ◄── WeightSyncer.sync(v) ◄── PolicyTrainer.step
    every actor ──Event("step" | "sync" | "eval" | "busy" | "exited" | "error")──► controller

Flow control is by *credits*: the trainer says how many groups it wants issued in total, and
generator ``r`` of ``K`` makes its share of them. ``mode="async"`` keeps ``1 + max_ahead``
steps' worth outstanding, so generation overlaps training; ``mode="sync"`` issues one step's
worth only after the weights of the previous step reached the server, so the two alternate.
Nothing else differs between the modes. A group older than ``max_staleness`` versions is
dropped (counted) and replaced by a new credit.

Shutdown mirrors the toy ring: the trainer drains the generators (each sends ``None``), the
scorer and reference forward one ``None``, the trainer discards what is still queued.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from functools import cache
from types import ModuleType, SimpleNamespace
from typing import Any

from grpo_nb.llm_config import LLMConfig
from grpo_nb.llm_trainer import ScoredGroup
from grpo_nb.ring import Event, cancel_task, stage_base


@dataclass
class RingSpec:
    """Everything the actors need besides the config (plain data: it pickles for Monarch)."""

    server_url: str
    model_name: str
    model_dir: str
    prompts: list[tuple[list[int], str]]
    eval_prompts: Any = None  # (prompt_ids [N, P], answer_ids [N, A]) tensors
    run_dir: str | None = None
    resume_dir: str | None = None


def share(total: int, rank: int, k: int) -> int:
    """Generator ``rank``'s share of ``total`` groups split as evenly as possible over ``k``."""
    return total // k + (1 if rank < total % k else 0)


@cache
def actor_classes(api: ModuleType) -> SimpleNamespace:
    """``Generator``, ``Scorer``, ``Reference``, ``Trainer`` for the given actor API."""

    class _Stage(stage_base(api)):  # launch / guard / cleanup: grpo_nb.ring
        quiet_cancel = True

        def _busy(self, label: str, start: float) -> None:
            self.metrics.send(Event("busy", [(self.name, label, start, time.time())]))

    class Generator(_Stage):
        def __init__(self, cfg: LLMConfig, spec: RingSpec, out: Any, metrics: Any) -> None:
            self.cfg, self.spec, self.out, self.metrics = cfg, spec, out, metrics
            self.version, self.step, self.allowed, self.made = 0, 0, 0, 0
            self.changed = asyncio.Event()

        @api.endpoint
        async def start(self) -> None:
            rank = api.current_rank().rank
            self.rank, self.name = rank, f"gen{rank}"
            self.rng = random.Random(self.cfg.seed * 1009 + rank)
            self._launch(self._produce())

        @api.endpoint
        async def progress(self, step: int, version: int, issued: int) -> None:
            self.step, self.version = step, version
            self.allowed = share(issued, self.rank, self.cfg.generators)
            self.changed.set()

        async def _produce(self) -> None:
            from grpo_nb.client import ClientConfig, CompletionsClient

            slots = max(1, self.cfg.max_inflight // self.cfg.group_size)
            client = CompletionsClient(self.spec.server_url + "/v1", self.spec.model_name,
                                       ClientConfig(max_in_flight=slots, timeout_s=60.0,
                                                    retries=2))
            running: set[asyncio.Task] = set()
            try:
                while True:
                    while self.made >= self.allowed or len(running) >= slots:
                        self.changed.clear()
                        waiter = asyncio.ensure_future(self.changed.wait())
                        try:
                            done, _ = await asyncio.wait([waiter, *running],
                                                         return_when="FIRST_COMPLETED")
                        finally:  # also when cancelled: no pending task left behind
                            waiter.cancel()
                        for t in done & running:
                            running.discard(t)
                            t.result()  # a failed request ends the generator (and the run)
                    self.made += 1
                    running.add(asyncio.create_task(self._one_group(client)))
            finally:
                for t in running:
                    t.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                await client.close()

        async def _one_group(self, client: Any) -> None:
            prompt, answer = self.rng.choice(self.spec.prompts)
            version, start = self.version, time.time()
            outs = await client.complete(prompt, max_tokens=self.cfg.max_tokens,
                                         temperature=self.cfg.temperature,
                                         n=self.cfg.group_size)
            self.out.send(ScoredGroup(
                prompt_ids=list(prompt), answer=answer,
                completions=[o.token_ids for o in outs],
                sampler_logprobs=[o.logprobs for o in outs],
                finish_reasons=[o.finish_reason for o in outs], texts=[o.text for o in outs],
                version=version, source=self.name, created=start))
            self._busy("generate", start)

        @api.endpoint
        async def drain(self) -> None:
            await cancel_task(getattr(self, "_task", None), quiet=self.quiet_cancel)
            self.out.send(None)

    class Scorer(_Stage):
        name = "scorer"

        def __init__(self, cfg: LLMConfig, metrics: Any) -> None:
            self.cfg, self.metrics = cfg, metrics
            self.port, self.inbox = api.Channel.open()

        @api.endpoint
        async def inlet(self) -> Any:
            return self.port

        @api.endpoint
        async def start(self, out: Any) -> None:
            self._launch(self._score(out))

        async def _score(self, out: Any) -> None:
            import torch

            from grpo_nb import grpo, tasks

            sentinels = 0
            while sentinels < self.cfg.generators:
                group = await self.inbox.recv()
                if group is None:
                    sentinels += 1
                    continue
                start = time.time()
                # Exact answer *then* end-of-sequence: a completion cut at max_tokens scores 0.
                group.rewards = [tasks.reward(text, group.answer) if reason == "stop" else 0.0
                                 for text, reason in zip(group.texts, group.finish_reasons,
                                                         strict=True)]
                adv = grpo.group_advantages(torch.tensor(group.rewards), self.cfg.group_size)
                group.advantages = adv.tolist()
                out.send(group)
                self._busy("score", start)
            out.send(None)
            self.metrics.send(Event("exited", {"actor": self.name}))

    class Reference(_Stage):
        name = "reference"

        def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any) -> None:
            self.cfg, self.metrics = cfg, metrics
            self.model = None
            if cfg.kl_coef > 0:  # the reference model costs memory and time: only if used
                from grpo_nb.tiny_model import load_hf

                self.model, _ = load_hf(spec.model_dir)
                self.model.requires_grad_(False)
            self.port, self.inbox = api.Channel.open()

        @api.endpoint
        async def inlet(self) -> Any:
            return self.port

        @api.endpoint
        async def start(self, out: Any) -> None:
            self._launch(self._annotate(out))

        async def _annotate(self, out: Any) -> None:
            while (group := await self.inbox.recv()) is not None:
                if self.model is not None:
                    start = time.time()
                    group.ref_logprobs = await asyncio.to_thread(self._ref_logprobs, group)
                    self._busy("ref logp", start)
                out.send(group)
            out.send(None)
            self.metrics.send(Event("exited", {"actor": self.name}))

        def _ref_logprobs(self, group: ScoredGroup) -> list[list[float]]:
            import torch

            from grpo_nb.llm_trainer import make_batch, sequence_logprobs

            b = make_batch([group], pad_id=0)
            with torch.no_grad():
                lp = sequence_logprobs(self.model, b.input_ids, b.attention_mask,
                                       self.cfg.temperature)
            p = len(group.prompt_ids)
            return [lp[i, p - 1:p - 1 + len(c)].tolist() for i, c in enumerate(group.completions)]

    from grpo_nb.llm_trainer_actor import trainer_actor

    return SimpleNamespace(Generator=Generator, Scorer=Scorer, Reference=Reference,
                           Trainer=trainer_actor(api, _Stage))
