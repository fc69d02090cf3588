"""The LLM GRPO ring: the toy ring's four stages, now driving a Qwen model served by vLLM.

The stages are :mod:`grpo_nb.ring`'s skeleton with the LLM's work filled in; each hop carries
one message type, :class:`grpo_nb.serving.rollouts.Group`::

    Generator × K ──Group──► Scorer ──+rewards, advantages──► Reference ──+ref logp──► Trainer
      │ (Source)                (Relay)                        (Relay; passes       │ (Sink)
      │ ≤ max_inflight sequences in flight each,                through when        │ staleness
      │ /v1/completions with token ids + logprobs               kl_coef == 0)       │ admission
      ▲                                                                             ▼
      └──── progress(version, issued) to all ◄── WeightSyncer.sync(v) ◄── PolicyTrainer.step
    every stage ──Event("step" | "sync" | "eval" | "dropped" | "busy" | "exited" | "error")──►
    controller (grpo_nb.llm.run)

Flow control is by *credits*: the trainer says how many groups it wants issued in total, and
generator ``r`` of ``K`` makes its share of them. ``mode="async"`` keeps ``1 + max_ahead``
steps' worth outstanding, so generation overlaps training; ``mode="sync"`` issues one step's
worth only after the weights of the previous step reached the server, so the two alternate.
Nothing else differs between the modes. The trainer drops a group older than
``max_staleness`` versions (counted) and issues a new credit in its place.

Shutdown is the skeleton's: the trainer drains the generators (each sends ``None``), the
scorer and reference forward one ``None``, the trainer discards what is still queued.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import torch

from grpo_nb import grpo, tasks
from grpo_nb.actors import current_rank, endpoint
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Prompt, RingSpec
from grpo_nb.llm.trainer import PolicyTrainer, make_batch, sequence_logprobs
from grpo_nb.ring import Relay, Sink, Source, cancel_task
from grpo_nb.serving.client import ClientConfig, CompletionsClient
from grpo_nb.serving.rollouts import Group, Rollout

__all__ = ["Generator", "Reference", "RingSpec", "Scorer", "Trainer", "share"]


def share(total: int, rank: int, k: int) -> int:
    """Generator ``rank``'s share of ``total`` groups split as evenly as possible over ``k``."""
    return total // k + (1 if rank < total % k else 0)


class Generator(Source):
    """Samples groups from the vLLM server, as many as the trainer's credits allow."""

    quiet_cancel = True  # cancelled mid-request at drain: the HTTP client may complain

    def __init__(self, cfg: LLMConfig, spec: RingSpec, out: Any, metrics: Any) -> None:
        self.cfg, self.spec, self.out = cfg, spec, out
        self.rank = current_rank().rank
        self.attach(metrics, f"gen{self.rank}")
        self.rng = random.Random(cfg.seed * 1009 + self.rank)
        self.version = self.allowed = self.made = 0
        self.changed = asyncio.Event()

    @endpoint
    async def start(self) -> None:
        self.launch(self._produce())

    @endpoint
    async def progress(self, version: int, issued: int) -> None:
        """The trainer's weight version, and how many groups the ring may have issued."""
        self.version = version
        self.allowed = share(issued, self.rank, self.cfg.generators)
        self.changed.set()

    async def _produce(self) -> None:
        slots = max(1, self.cfg.max_inflight // self.cfg.group_size)
        client = CompletionsClient(self.spec.server_url + "/v1", self.spec.model_name,
                                   ClientConfig(max_in_flight=slots, timeout_s=60.0, retries=2))
        running: set[asyncio.Task] = set()
        try:
            while True:
                while self.made >= self.allowed or len(running) >= slots:
                    self.changed.clear()
                    waiter = asyncio.ensure_future(self.changed.wait())
                    try:
                        done, _ = await asyncio.wait([waiter, *running],
                                                     return_when=asyncio.FIRST_COMPLETED)
                    finally:  # also when cancelled: no pending task left behind
                        waiter.cancel()
                    for t in done & running:
                        running.discard(t)
                        t.result()  # a failed request ends the generator (and the run)
                self.made += 1
                running.add(asyncio.create_task(self._one_group(client, self.made)))
        finally:
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await client.close()

    async def _one_group(self, client: CompletionsClient, group_id: int) -> None:
        prompt: Prompt = self.rng.choice(self.spec.prompts)
        version, start = self.version, time.time()
        # One request with n = group_size: the server shares the prompt's prefill.
        outs = await client.complete(prompt.ids, max_tokens=self.cfg.max_tokens,
                                     temperature=self.cfg.temperature, n=self.cfg.group_size)
        rollouts = [Rollout(list(prompt.ids), o.token_ids, o.logprobs, o.text, o.finish_reason,
                            policy_version=version, group_id=group_id, latency_s=o.latency_s)
                    for o in outs]
        self.out.send(Group(group_id, prompt.text, prompt.answer, list(prompt.ids), rollouts,
                            version, t_submit=start, t_done=time.time(), source=self.name))
        self.busy.add("generate", start)


class Scorer(Relay):
    """Rewards every completion, then turns a group's rewards into advantages."""

    name = "scorer"
    label = "score"

    def __init__(self, cfg: LLMConfig, metrics: Any) -> None:
        self.cfg = cfg
        self.upstream = cfg.generators  # each generator ends with one None
        self.attach(metrics)
        self.open_inlet()

    async def process(self, group: Group) -> Group:
        for r in group.rollouts:
            # Exact answer *then* end-of-sequence: a completion cut at max_tokens scores 0.
            r.reward = (tasks.reward(r.completion_text, group.answer)
                        if r.finish_reason == "stop" else 0.0)
        adv = grpo.group_advantages(torch.tensor(group.rewards), self.cfg.group_size)
        for r, a in zip(group.rollouts, adv.tolist(), strict=True):
            r.advantage = a
        return group


class Reference(Relay):
    """Adds the frozen base model's log-probs of each completion (for the KL penalty)."""

    name = "reference"

    def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any) -> None:
        self.cfg = cfg
        self.attach(metrics)
        self.open_inlet()
        self.model = None
        if cfg.kl_coef > 0:  # the reference model costs memory and time: only if used
            from grpo_nb.tiny_model import load_hf

            self.model, _ = load_hf(spec.model_dir)
            self.model.requires_grad_(False)
        self.label = "ref logp" if self.model is not None else "pass through"

    async def process(self, group: Group) -> Group:
        if self.model is not None:
            per_rollout = await asyncio.to_thread(self._ref_logprobs, group)
            for r, lp in zip(group.rollouts, per_rollout, strict=True):
                r.ref_logprobs = lp
        return group

    def _ref_logprobs(self, group: Group) -> list[list[float]]:
        b = make_batch([group], pad_id=0)
        with torch.no_grad():
            lp = sequence_logprobs(self.model, b.input_ids, b.attention_mask,
                                   self.cfg.temperature)
        p = len(group.prompt_ids)
        return [lp[i, p - 1:p - 1 + len(r.completion_ids)].tolist()
                for i, r in enumerate(group.rollouts)]


class Trainer(Sink):
    """Admits fresh groups, steps the policy, pushes weights, evaluates, checkpoints.

    ::

        inbox ──► admit? staleness = step − group.policy_version ≤ max_staleness
          │ no: dropped += 1, one more credit                      │ yes
          │                         PolicyTrainer.step(groups)   (worker thread)
          │                         WeightSyncer.sync(step)      (worker thread, every sync_every)
          └── progress(version, issued) to generators ◄────────────┘
                                    eval / checkpoint every N steps; Event rows to controller

    Heavy torch work runs in ``asyncio.to_thread``: the event loop keeps receiving groups and
    the generators keep their HTTP requests going while the trainer computes — that is where
    async mode's overlap comes from on a 2-core CPU (vLLM's worker is pinned to one core).
    """

    name = "trainer"
    quiet_cancel = True  # cancelled while a worker thread computes

    def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any) -> None:
        from grpo_nb.tiny_model import load_hf
        from grpo_nb.weight_sync import WeightSyncer

        self.cfg, self.spec = cfg, spec
        self.attach(metrics)
        self.open_inlet()
        model, tok = load_hf(spec.resume_dir or spec.model_dir)
        self.pt = PolicyTrainer(model, tok, cfg, spec.eval_prompts)
        resumed = self.pt.load(spec.resume_dir) if spec.resume_dir else {}
        self.syncer = WeightSyncer(spec.server_url, model, cfg.sync)
        self.stopping = asyncio.Event()
        self.next_msg: asyncio.Task | None = None  # a receive still pending when stop came
        self.issued = self.received = self.syncs = 0
        self.dropped = int(resumed.get("dropped", 0))

    @endpoint
    async def start(self, generators: Any) -> None:
        self.launch(self._train(generators))

    @endpoint
    async def request_stop(self) -> None:
        """Finish the current step, then drain, sync, evaluate and checkpoint."""
        self.stopping.set()

    def _progress(self, generators: Any) -> None:
        generators.progress.broadcast(self.pt.version, self.issued)

    async def _train(self, generators: Any) -> None:
        cfg = self.cfg
        await self._sync(verify=True)  # the server starts from the base model: align + check
        await self._eval()
        ahead = cfg.max_ahead if cfg.mode == "async" else 0
        self.issued = (1 + ahead) * cfg.prompts_per_step
        self._progress(generators)
        t0 = time.time()
        while self.pt.step_count < cfg.steps and not self.stopping.is_set():
            if cfg.time_budget_s is not None and time.time() - t0 > cfg.time_budget_s:
                break
            groups = await self._collect(generators)
            if groups is None:
                break
            start = time.time()
            row = await asyncio.to_thread(self.pt.step, groups)
            self.busy.add("train", start)
            now = time.time()
            row.update(staleness=[self.pt.step_count - 1 - g.policy_version for g in groups],
                       age_s=[now - g.t_submit for g in groups], dropped=self.dropped,
                       train_s=now - start, wall_s=now - t0, version=self.pt.version)
            self.report("step", **row)
            if self.pt.step_count % cfg.sync_every == 0:
                await self._sync()
            # async: keep 1 + max_ahead steps' worth outstanding; sync: exactly one step's.
            self.issued = self.received + (1 + ahead) * cfg.prompts_per_step
            self._progress(generators)
            if self.pt.step_count % cfg.eval_every == 0:
                await self._eval()
            if self.pt.step_count % cfg.checkpoint_every == 0:
                await asyncio.to_thread(self._checkpoint)
        await self._finish(generators)

    async def _collect(self, generators: Any) -> list[Group] | None:
        """One step's worth of admitted groups (``None`` once a stop is requested)."""
        groups: list[Group] = []
        while len(groups) < self.cfg.prompts_per_step:
            group = await self._next_admitted(generators)
            if group is None:
                return None
            groups.append(group)
        return groups

    async def _next_admitted(self, generators: Any) -> Group | None:
        """The next group fresh enough to train on (``None`` once a stop is requested)."""
        while (group := await self._receive_unless_stopping()) is not None:
            self.received += 1
            staleness = self.pt.step_count - group.policy_version
            if staleness <= self.cfg.max_staleness:
                return group
            self.dropped += 1
            self.issued += 1  # replace it, or the step would wait forever
            self._progress(generators)
            self.report("dropped", step=self.pt.step_count, staleness=staleness,
                        total=self.dropped)
        return None

    async def _receive_unless_stopping(self) -> Group | None:
        """The next message, or ``None`` as soon as a stop is requested. A receive still
        pending then is kept in ``next_msg``, so :meth:`_finish` loses nothing it brings."""
        if self.stopping.is_set():
            return None
        if self.next_msg is None:
            self.next_msg = asyncio.ensure_future(self._receive())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({self.next_msg, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not self.next_msg.done():
            return None
        msg, self.next_msg = self.next_msg.result(), None
        return msg

    async def _receive(self) -> Any:
        return await self.inbox.recv()

    async def _sync(self, *, verify: bool | None = None) -> None:
        start = time.time()
        self.syncs += 1
        if verify is None:
            verify = self.cfg.sync.verify and self.syncs % self.cfg.verify_every == 0
        res = await asyncio.to_thread(self.syncer.sync, self.pt.step_count, verify=verify)
        self.pt.version = res.version
        if res.verified:
            self.pt.last_verified = res.version
        self.busy.add("sync", start)
        self.report("sync", step=self.pt.step_count, version=res.version, ms=res.ms,
                    bytes=res.bytes, verified=res.verified, gap=self.syncer.last_gap)

    async def _eval(self) -> None:
        start = time.time()
        acc = await asyncio.to_thread(self.pt.evaluate)
        self.busy.add("eval", start)
        self.report("eval", step=self.pt.step_count, accuracy=acc)

    def _checkpoint(self) -> None:
        if self.spec.run_dir is not None:
            self.pt.save(Path(self.spec.run_dir) / "checkpoint",
                         {"dropped": self.dropped, "received": self.received})

    async def _finish(self, generators: Any) -> None:
        await generators.drain.call()
        pending, self.next_msg = self.next_msg, None
        first = await pending if pending is not None else await self._receive()
        leftover = 0 if first is None else 1 + await self.discard_queued()
        if self.pt.version != self.pt.step_count or self.pt.last_verified != self.pt.version:
            await self._sync(verify=True)  # the run ends on verified weights
        if self.pt.step_count % self.cfg.eval_every != 0:
            await self._eval()
        await asyncio.to_thread(self._checkpoint)
        self.busy.flush()  # before "exited": the controller stops listening then
        self.report("exited", actor=self.name, dropped=self.dropped, leftover=leftover,
                    steps=self.pt.step_count)

    async def __cleanup__(self, exc: Any) -> None:
        await super().__cleanup__(exc)
        await cancel_task(self.next_msg, quiet=True)
        self.syncer.close()
