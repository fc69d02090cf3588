"""The LLM GRPO ring's four stages on :mod:`grpo_nb.ring`'s skeleton; each hop carries one
:class:`~grpo_nb.llm.data.Group`."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from grpo_nb import tasks
from grpo_nb.actors import endpoint
from grpo_nb.llm import placement
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, RingSpec
from grpo_nb.llm.policy import PolicyTrainer, completion_logprobs, load_policy
from grpo_nb.llm.rollouts import finish_scoring, greedy_accuracy, sample_group, token_lags
from grpo_nb.ring import DynamicSampling, Relay, RingError, Sink, Source, cancel_task
from grpo_nb.serving.client import ClientConfig, CompletionError, CompletionsClient, policy_salt
from grpo_nb.tasks.scoring import BoundedReward
from grpo_nb.weight_sync import WeightSyncer


def admit(step: int, group_version: int, max_staleness: int) -> bool:
    """Train on a group whose oldest token was sampled with weights ``step - group_version``
    versions old? The trainer passes ``Group.policy_version``, its oldest token's version: a
    completion a sync split between two versions counts by its older part."""
    return step - group_version <= max_staleness


def _client(spec: RingSpec, max_in_flight: int, timeout_s: float) -> CompletionsClient:
    return CompletionsClient(spec.server_url + "/v1", spec.model_name,
                             ClientConfig(max_in_flight=max_in_flight, timeout_s=timeout_s,
                                          retries=2), api_key=spec.api_key)


class Generator(Source):
    """Samples groups from the vLLM server as credits allow; a failed request is counted and
    another prompt drawn, until more than ``error_budget`` fail."""

    quiet_cancel = True  # cancelled mid-request at drain: the HTTP client may complain

    def __init__(self, cfg: LLMConfig, spec: RingSpec, out: Any, metrics: Any) -> None:
        self.cfg, self.spec, self.out = cfg, spec, out
        self.open_credits(cfg.generators, metrics)
        self.rng = random.Random(cfg.seed * 1009 + self.rank)
        self.failed = self.aborted = 0

    @endpoint
    async def start(self) -> None:
        self.launch(self._produce())

    async def _produce(self) -> None:
        slots = max(1, self.cfg.max_inflight // self.cfg.group_size)
        client = _client(self.spec, slots, 60.0)
        running: set[asyncio.Task] = set()
        try:
            while True:
                await self.credit(running, slots)  # a group over the error budget raises here
                running.add(asyncio.create_task(self._one_group(client, self.made)))
        finally:
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await client.close()

    async def _one_group(self, client: CompletionsClient, group_id: int) -> None:
        start = time.time()
        while True:
            try:
                group = await sample_group(client, self.rng.choice(self.spec.prompts), self.cfg,
                                           lambda: self.trainer_version, group_id=group_id,
                                           source=self.name, on_abort=self._aborted)
                break
            except CompletionError as err:
                self.failed += 1
                self.report("request_failed", actor=self.name, total=self.failed,
                            status=err.status, error=str(err)[:300])
                if self.failed > self.cfg.error_budget:
                    s = client.stats
                    raise RingError(
                        f"{self.name}: {self.failed} failed requests (> LLMConfig.error_budget="
                        f"{self.cfg.error_budget}); last: {err} [client counts: 4xx={s.http_4xx}"
                        f" 5xx={s.http_5xx} timeouts={s.timeouts} connection="
                        f"{s.connection_errors}]") from err
                await asyncio.sleep(0.2)  # a struggling server: do not hammer it
        self.out.send(group)
        self.busy.add("generate", start)

    def _aborted(self) -> None:
        self.aborted += 1
        self.report("aborted", actor=self.name, total=self.aborted)


class Scorer(Relay):
    """Rewards every completion with ``cfg.reward`` off the event loop, each within
    ``cfg.score_timeout_s`` (past it: reward 0 and a ``score_timeout`` row), one cut at
    ``max_tokens`` 0; then ``cfg.overlong`` and the group's advantages
    (:func:`~grpo_nb.llm.rollouts.finish_scoring`)."""

    name, label, sender = "scorer", "score", "the generators"
    timeout_field = "LLMConfig.finish_timeout_s"

    def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any) -> None:
        self.cfg = cfg
        self.upstream = cfg.generators  # each generator ends with one None
        self.finish_timeout_s = cfg.finish_timeout_s  # bounds the wait for the last ones
        self.reward = BoundedReward(tasks.make_reward(cfg.reward, default=spec.reward_default),
                                    cfg.score_timeout_s)
        self.timeouts = 0
        self.open_inlet(metrics)

    async def process(self, group: Group) -> Group:
        done = [r for r in group.rollouts if r.finish_reason == "stop"]
        values = await self.reward.score([(r.completion_text, group.answer) for r in done])
        for r in group.rollouts:
            r.reward = 0.0
        for r, value in zip(done, values, strict=True):
            if value is None:
                self.timeouts += 1
                self.report("score_timeout", actor=self.name, total=self.timeouts,
                            group_id=group.group_id, bound_s=self.cfg.score_timeout_s,
                            completion=r.completion_text[:300])
            r.reward = 0.0 if value is None else value
        return finish_scoring(group, self.cfg)

    async def _relay(self, out: Any) -> None:
        try:
            await super()._relay(out)
        finally:  # also when cancelled: no reward process outlives the stage
            await self.reward.close()


class Reference(Relay):
    """Adds the frozen base model's log-probs of each completion (only when ``kl_coef > 0``)."""

    name, sender = "reference", "scorer"

    def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any) -> None:
        self.cfg = cfg
        self.open_inlet(metrics)
        self.model = None
        if cfg.kl_coef > 0:  # the reference model costs memory and time: only if used
            self.model, _ = load_policy(spec.model_dir, placement.trainer_device(cfg),
                                        placement.dtype_of(cfg), trainable=False)
        self.label = "ref logp" if self.model is not None else "pass through"

    async def process(self, group: Group) -> Group:
        if self.model is not None:
            per_rollout = await asyncio.to_thread(completion_logprobs, self.model,
                                                  group.rollouts, self.cfg.temperature)
            for r, lp in zip(group.rollouts, per_rollout, strict=True):
                r.ref_logprobs = lp.tolist()
        return group


class Trainer(Sink):
    """Admits fresh groups, steps the policy, pushes weights and credits, evaluates, checkpoints;
    the torch work and the sync run in threads, so groups keep arriving meanwhile."""

    name, sender = "trainer", "reference"
    timeout_field = "LLMConfig.finish_timeout_s"
    quiet_cancel = True  # cancelled while a worker thread computes

    def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any) -> None:
        self.cfg, self.spec = cfg, spec
        self.finish_timeout_s = cfg.finish_timeout_s
        self.open_inlet(metrics)
        # Process-wide settings belong to the trainer's process (its own one on Monarch).
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.trainer_threads)
        model, tok = load_policy(spec.resume_dir or spec.model_dir,
                                 placement.trainer_device(cfg), placement.dtype_of(cfg))
        self.pt = PolicyTrainer(model, tok, cfg)
        resumed = self.pt.load(spec.resume_dir) if spec.resume_dir else {}
        self.syncer = WeightSyncer(spec.server_url, model, placement.sync_of(cfg),
                                   api_key=spec.api_key, salted=True)
        self.deadline: float | None = None  # time.time() at which the time budget runs out
        self.next_timed = cfg.checkpoint_every_s  # training seconds of the next timed copy
        self.last_wall: tuple[int, float] | None = None  # the last step and its wall_s
        self.stopping = asyncio.Event()
        self.next_msg: asyncio.Future | None = None  # a receive still pending when stop came
        self.issued = self.received = self.syncs = 0
        self.dropped = int(resumed.get("dropped", 0))
        self.dynamic = DynamicSampling(cfg.prompts_per_step,
                                       total=int(resumed.get("dynamic_dropped", 0)))

    @endpoint
    async def start(self, generators: Any) -> None:
        self.launch(self._train(generators))

    @endpoint
    async def request_stop(self) -> None:
        """Finish the current step, then drain, sync, evaluate and checkpoint."""
        self.stopping.set()

    def _credit(self, generators: Any, issued: int) -> None:
        """Let the ring have issued ``issued`` groups in all: the generators' credits."""
        self.issued = issued
        generators.progress.broadcast(self.pt.version, issued)

    async def _train(self, generators: Any) -> None:
        cfg = self.cfg
        await self._sync(verify=True)  # the server starts from the base model: align + check
        await self._eval()
        outstanding = (1 + (cfg.max_ahead if cfg.mode == "async" else 0)) * cfg.prompts_per_step
        self._credit(generators, outstanding)
        t0 = time.time()
        self.deadline = None if cfg.time_budget_s is None else t0 + cfg.time_budget_s
        while self.pt.step_count < cfg.steps and not self.stopping.is_set():
            self.dynamic.new_step()
            groups = await self._collect(generators)
            if groups is None:  # stop requested, or the time budget ran out while waiting
                break
            start = time.time()
            row = await asyncio.to_thread(self.pt.step, groups)
            self.busy.add("train", start)
            if "skipped" in row:  # non-finite: weights unchanged, nothing to sync
                self.report("skipped", step=row["step"], reason=row["skipped"],
                            total=row["skipped_steps"])
                if self.pt.skipped > cfg.error_budget:
                    raise RingError(f"trainer: {self.pt.skipped} steps skipped for a non-finite "
                                    f"loss or gradient (> LLMConfig.error_budget="
                                    f"{cfg.error_budget}); last: {row['skipped']} at step "
                                    f"{row['step'] + 1}")
                self._credit(generators, self.received + outstanding)
                continue
            now = time.time()
            row.update(**token_lags(groups, self.pt.step_count - 1),
                       staleness=[self.pt.step_count - 1 - g.policy_version for g in groups],
                       age_s=[now - g.t_submit for g in groups], dropped=self.dropped,
                       train_s=now - start, wall_s=now - t0, version=self.pt.version,
                       **self.dynamic.row())
            self.report("step", **row)
            self.last_wall = (self.pt.step_count, row["wall_s"])
            if self.next_timed is not None and row["wall_s"] >= self.next_timed:
                await self._timed_checkpoint()
            if self.pt.step_count % cfg.sync_every == 0:
                await self._sync()
            self._credit(generators, self.received + outstanding)
            if self.pt.step_count % cfg.eval_every == 0:
                await self._eval()
            if self.pt.step_count % cfg.checkpoint_every == 0:
                await asyncio.to_thread(self._checkpoint)
        await self._finish(generators)

    async def _collect(self, generators: Any) -> list[Group] | None:
        """One step's admitted groups, or ``None`` once a stop or the time budget comes; a receive
        then pending stays in ``next_msg`` for :meth:`_finish` (cancelling it could lose a group).
        A stale group, and with ``dynamic_sampling`` one whose rewards are all equal (up to the
        cap, :class:`~grpo_nb.ring.DynamicSampling`), is dropped and a replacement credited."""
        groups: list[Group] = []
        while len(groups) < self.cfg.prompts_per_step:
            left = None if self.deadline is None else self.deadline - time.time()
            if self.stopping.is_set() or (left is not None and left <= 0):
                return None
            if self.next_msg is None:
                self.next_msg = asyncio.ensure_future(self.inbox.recv())
            stop = asyncio.ensure_future(self.stopping.wait())
            try:
                await asyncio.wait({self.next_msg, stop}, timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if not self.next_msg.done():
                continue  # stopped or out of time: checked at the top
            group, self.next_msg = self.next_msg.result(), None
            if group is None:  # the end of the stream
                return None
            self.received += 1
            if admit(self.pt.step_count, group.policy_version, self.cfg.max_staleness):
                if self.cfg.dynamic_sampling and self.dynamic.drops(group.rewards):
                    self._credit(generators, self.issued + 1)  # all rewards equal: replace it
                    continue
                groups.append(group)
                continue
            self.dropped += 1
            self._credit(generators, self.issued + 1)  # replace it, or the step never fills
            self.report("dropped", step=self.pt.step_count,
                        staleness=self.pt.step_count - group.policy_version, total=self.dropped)
        return groups

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
                    bytes=res.bytes, verified=res.verified,
                    phases={k: round(v, 2) for k, v in res.phases.items()})

    async def _eval(self) -> None:
        """Greedy accuracy on the held-out prompts, sampled by the server."""
        if self.pt.version != self.pt.step_count:
            await self._sync()  # evaluate the weights just trained, not the last synced ones
        start = time.time()
        async with _client(self.spec, 4, 600.0) as client:
            res = await greedy_accuracy(client, self.spec.eval_prompts,
                                        tasks.make_reward(self.spec.reward_default),
                                        self.cfg.max_tokens,
                                        cache_salt=policy_salt(self.pt.version))
        self.busy.add("eval", start)
        self.report("eval", step=self.pt.step_count, accuracy=res.accuracy, n=res.n,
                    truncated=res.truncated, version=self.pt.version, pid=os.getpid())

    def _checkpoint(self) -> None:
        if self.spec.run_dir is not None:
            self.pt.save(Path(self.spec.run_dir) / "checkpoint",
                         {"dropped": self.dropped, "received": self.received,
                          "dynamic_dropped": self.dynamic.total})

    async def _timed_checkpoint(self) -> None:
        """The weights after step ``n`` at ``wall_s`` training seconds, kept (never replaced) in
        ``timed/t<wall_s>-s<n>``; the next is due at the next multiple of ``checkpoint_every_s``."""
        every = self.cfg.checkpoint_every_s
        if self.spec.run_dir is None or self.last_wall is None or every is None:
            return
        start, (step, wall) = time.time(), self.last_wall
        folder = Path(self.spec.run_dir) / "timed" / f"t{wall:09.3f}-s{step:06d}"
        if folder.exists():  # this step is saved already (the run's end)
            return
        await asyncio.to_thread(self.pt.model.save_pretrained, folder)
        await asyncio.to_thread(self.pt.tokenizer.save_pretrained, folder)
        self.next_timed = (wall // every + 1) * every
        self.busy.add("checkpoint", start)
        self.report("timed_checkpoint", step=step, wall_s=wall, path=str(folder),
                    save_s=round(time.time() - start, 4))

    async def _finish(self, generators: Any) -> None:
        try:  # drain the generators, read to the end of the stream: groups left unused
            await self.drain_sources(generators, self.cfg.generators)
            pending, self.next_msg = self.next_msg, None
            first = await self.recv_within("the end of the stream", pending)
            leftover = 0 if first is None else 1 + await self.discard_queued()
        except RingError:
            await asyncio.to_thread(self._checkpoint)  # a dead peer must not cost the steps
            raise
        if self.pt.version != self.pt.step_count or self.pt.last_verified != self.pt.version:
            await self._sync(verify=True)  # the run ends on verified weights
        if self.pt.step_count % self.cfg.eval_every != 0:
            await self._eval()
        await asyncio.to_thread(self._checkpoint)
        await self._timed_checkpoint()  # the last step's weights, when timed copies are on
        self.busy.flush()  # before "exited": the controller stops listening then
        self.report("exited", actor=self.name, dropped=self.dropped, leftover=leftover,
                    steps=self.pt.step_count)

    async def __cleanup__(self, exc: Any) -> None:
        await super().__cleanup__(exc)
        await cancel_task(self.next_msg, quiet=True)
        self.syncer.close()
