"""The LLM GRPO ring's four stages on :mod:`grpo_nb.ring`'s skeleton; each hop carries one
:class:`~grpo_nb.llm.data.Group`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_nb import partition, tasks
from grpo_nb.actors import endpoint
from grpo_nb.llm import placement
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, RingSpec
from grpo_nb.llm.policy import PolicyTrainer, completion_logprobs, load_policy
from grpo_nb.llm.rollouts import finish_scoring, greedy_accuracy, sample_group, token_lags
from grpo_nb.ring import Relay, RingError, Sink, Source
from grpo_nb.ring_core import Admit, Ledger, staleness
from grpo_nb.ring_core import admit as admit  # notebook 05 compares the learner's with it
from grpo_nb.serving.client import ClientConfig, CompletionError, CompletionsClient, policy_salt
from grpo_nb.tasks.scoring import BoundedReward
from grpo_nb.weight_sync import WeightSyncer


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
            per_rollout = await asyncio.to_thread(completion_logprobs, self.model, [group],
                                                  self.cfg.temperature)
            for r, lp in zip(group.rollouts, per_rollout, strict=True):
                r.ref_logprobs = lp.tolist()
        return group


def step_row(row: dict[str, Any], groups: list[Group], version: int, ledger: Ledger,
             **timing: float) -> dict[str, Any]:
    """The ``step`` row: ``PolicyTrainer.step``'s, with each group's staleness and age, the token
    lags and the ledger's drops, for groups trained on by weights ``version``."""
    now = time.time()
    return {**row, **token_lags(groups, version),
            "staleness": [staleness(version, g.policy_version) for g in groups],
            "age_s": [now - g.t_submit for g in groups], "dropped": ledger.stale, **timing,
            **ledger.dynamic.row()}


class Learner:
    """The trainer's policy and what it owes the server and the run folder: the weight syncs
    (:meth:`sync`), evaluations of the served weights (:meth:`evaluate`), the checkpoint
    (:meth:`save`, replaced each time) and the timed copies (:meth:`timed`, kept); each timed in
    ``busy`` and reported as its row."""

    def __init__(self, cfg: LLMConfig, spec: RingSpec, busy: Any,
                 report: Callable[..., None]) -> None:
        self.cfg, self.spec, self.busy, self.report = cfg, spec, busy, report
        model, tok = load_policy(spec.resume_dir or spec.model_dir, placement.trainer_device(cfg),
                                 placement.dtype_of(cfg))
        self.pt = PolicyTrainer(model, tok, cfg)
        self.resumed = self.pt.load(spec.resume_dir) if spec.resume_dir else {}
        self.syncer = WeightSyncer(spec.server_url, model, placement.sync_of(cfg),
                                   api_key=spec.api_key, salted=True)
        self.run_dir = None if spec.run_dir is None else Path(spec.run_dir)
        self.next_timed = cfg.checkpoint_every_s  # training seconds of the next timed copy
        self.last_wall: tuple[int, float] | None = None  # the last step and its wall_s
        self.syncs = 0

    async def sync(self, *, verify: bool | None = None) -> None:
        """Push the weights as version ``step_count`` (in a thread); ``verify`` None: at every
        ``verify_every``-th sync, if ``cfg.sync.verify``."""
        start, pt, self.syncs = time.time(), self.pt, self.syncs + 1
        if verify is None:
            verify = self.cfg.sync.verify and self.syncs % self.cfg.verify_every == 0
        res = await asyncio.to_thread(self.syncer.sync, pt.step_count, verify=verify)
        pt.version = res.version
        if res.verified:
            pt.last_verified = res.version
        self.busy.add("sync", start)
        self.report("sync", step=pt.step_count, version=res.version, ms=res.ms, bytes=res.bytes,
                    verified=res.verified, phases={k: round(v, 2) for k, v in res.phases.items()})

    async def evaluate(self) -> None:
        """Greedy accuracy on the held-out prompts, sampled by the server."""
        if self.pt.version != self.pt.step_count:
            await self.sync()  # evaluate the weights just trained, not the last synced ones
        start, spec = time.time(), self.spec
        async with _client(spec, 4, 600.0) as client:  # 64 prompts a request
            res = await greedy_accuracy(client, spec.eval_prompts,
                                        tasks.make_reward(spec.reward_default),
                                        self.cfg.max_tokens, cache_salt=policy_salt(self.pt.version))
        self.busy.add("eval", start)
        self.report("eval", step=self.pt.step_count, accuracy=res.accuracy, n=res.n,
                    truncated=res.truncated, version=self.pt.version, pid=os.getpid())

    def save(self, state: dict[str, Any]) -> None:
        """The checkpoint (weights, optimiser, ``state``) in the run folder, if there is one."""
        if self.run_dir is not None:
            self.pt.save(self.run_dir / "checkpoint", state)

    def due(self, step: int, wall_s: float) -> bool:
        """Step ``step`` ended at ``wall_s`` training seconds: is a timed copy due?"""
        self.last_wall = (step, wall_s)
        return self.next_timed is not None and wall_s >= self.next_timed

    async def timed(self) -> None:
        """The weights after step ``n`` at ``wall_s`` training seconds, kept (never replaced) in
        ``timed/t<wall_s>-s<n>``; the next is due at the next multiple of ``checkpoint_every_s``."""
        every = self.cfg.checkpoint_every_s
        if self.run_dir is None or self.last_wall is None or every is None:
            return
        start, (step, wall) = time.time(), self.last_wall
        folder = self.run_dir / "timed" / f"t{wall:09.3f}-s{step:06d}"
        if folder.exists():  # this step is saved already (the run's end)
            return
        await asyncio.to_thread(self.pt.model.save_pretrained, folder)
        await asyncio.to_thread(self.pt.tokenizer.save_pretrained, folder)
        self.next_timed = (wall // every + 1) * every
        self.busy.add("checkpoint", start)
        self.report("timed_checkpoint", step=step, wall_s=wall, path=str(folder),
                    save_s=round(time.time() - start, 4))


class Trainer(Sink):
    """Admits fresh groups, steps the policy, pushes weights and credits, evaluates, checkpoints;
    the torch work and the sync run in threads, so groups keep arriving meanwhile. ``admit``
    replaces the admission rule (:data:`grpo_nb.ring_core.Admit`)."""

    name, sender = "trainer", "reference"
    timeout_field = "LLMConfig.finish_timeout_s"
    quiet_cancel = True  # cancelled while a worker thread computes

    def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any,
                 admit: Admit | None = None) -> None:
        self.cfg, self.spec = cfg, spec
        self.finish_timeout_s = cfg.finish_timeout_s
        self.open_inlet(metrics)
        self.ledger = Ledger(cfg.mode, cfg.max_ahead, cfg.prompts_per_step,
                             max_staleness=cfg.max_staleness,
                             dynamic_sampling=cfg.dynamic_sampling, admit=admit,
                             report=self.report)
        # Process-wide settings of the trainer's process (its own one on Monarch): put back as
        # the trainer stops (__cleanup__), or at once if it fails to build.
        with contextlib.ExitStack() as settings:
            settings.enter_context(partition.torch_settings(cfg.trainer_threads, cfg.seed))
            self.learner = Learner(cfg, spec, self.busy, self.report)
            self.settings = settings.pop_all()
        self.pt = self.learner.pt
        self.ledger.restore(self.learner.resumed)
        self.stopping = asyncio.Event()

    @endpoint
    async def start(self, generators: Any) -> None:
        self.launch(self._train(generators))

    @endpoint
    async def request_stop(self) -> None:
        """Finish the current step, then drain, sync, evaluate and checkpoint."""
        self.stopping.set()

    def keep(self, group: Group) -> bool:
        """Train on ``group`` (by its oldest token's version)? The ledger credits a drop."""
        return self.ledger.take(self.pt.step_count, group.policy_version, group.rewards)

    async def _train(self, generators: Any) -> None:
        cfg, pt, ledger, learner = self.cfg, self.pt, self.ledger, self.learner
        await learner.sync(verify=True)  # the server starts from the base model: align + check
        await learner.evaluate()
        ledger.open(generators, pt.version)
        t0 = time.time()
        deadline = None if cfg.time_budget_s is None else t0 + cfg.time_budget_s
        while pt.step_count < cfg.steps and not self.stopping.is_set():
            ledger.dynamic.new_step()
            groups = await self.collect(cfg.prompts_per_step, self.keep, stopping=self.stopping,
                                        deadline=deadline)
            if groups is None:  # stop requested, the time budget ran out, or the stream ended
                break
            start = time.time()
            row = await asyncio.to_thread(pt.step, groups)
            self.busy.add("train", start)
            if "skipped" in row:  # non-finite: weights unchanged, nothing to sync
                self.report("skipped", step=row["step"], reason=row["skipped"],
                            total=row["skipped_steps"])
                if pt.skipped > cfg.error_budget:
                    raise RingError(f"trainer: {pt.skipped} steps skipped for a non-finite loss "
                                    f"or gradient (> LLMConfig.error_budget={cfg.error_budget});"
                                    f" last: {row['skipped']} at step {row['step'] + 1}")
                ledger.refill(pt.version)
                continue
            now = time.time()  # the groups met the weights before the step: step_count - 1
            self.report("step", **step_row(row, groups, pt.step_count - 1, ledger,
                                           train_s=now - start, wall_s=now - t0),
                        version=pt.version)
            if learner.due(pt.step_count, now - t0):
                await learner.timed()
            if pt.step_count % cfg.sync_every == 0:
                await learner.sync()
            ledger.refill(pt.version)
            if pt.step_count % cfg.eval_every == 0:
                await learner.evaluate()
            if pt.step_count % cfg.checkpoint_every == 0:
                await asyncio.to_thread(learner.save, ledger.state())
        await self._finish(generators)

    async def _finish(self, generators: Any) -> None:
        pt, learner = self.pt, self.learner
        try:  # drain the generators, read to the end of the stream: groups left unused
            await self.drain_sources(generators, self.cfg.generators)
            leftover = await self.discard_queued()
        except RingError:
            await asyncio.to_thread(learner.save, self.ledger.state())  # keep the steps made
            raise
        if pt.version != pt.step_count or pt.last_verified != pt.version:
            await learner.sync(verify=True)  # the run ends on verified weights
        if pt.step_count % self.cfg.eval_every != 0:
            await learner.evaluate()
        await asyncio.to_thread(learner.save, self.ledger.state())
        await learner.timed()  # the last step's weights, when timed copies are on
        self.busy.flush()  # before "exited": the controller stops listening then
        self.report("exited", actor=self.name, dropped=self.ledger.stale, leftover=leftover,
                    steps=pt.step_count)

    async def __cleanup__(self, exc: Any) -> None:
        await super().__cleanup__(exc)  # the loop, and a receive left pending
        self.learner.syncer.close()
        self.settings.close()
