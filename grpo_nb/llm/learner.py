"""The LLM ring's Trainer actor: admission, one optimiser step, weight sync, evaluation,
checkpoints — the consuming end (a :class:`~grpo_nb.ring.Sink`) of the ring whose producing
stages are in :mod:`grpo_nb.llm.actors`. The torch work itself is
:class:`grpo_nb.llm.trainer.PolicyTrainer`; this actor decides when it runs and on what.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import torch

from grpo_nb.actors import endpoint
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import RingSpec
from grpo_nb.llm.trainer import PolicyTrainer
from grpo_nb.ring import RingError, Sink, cancel_task
from grpo_nb.serving.client import ClientConfig, CompletionsClient
from grpo_nb.serving.rollouts import Group
from grpo_nb.weight_sync.client import policy_salt


class Trainer(Sink):
    """Admits fresh groups, steps the policy, pushes weights, evaluates, checkpoints.

    ::

        inbox ──► admit? staleness = step − group.policy_version ≤ max_staleness
          │ no: dropped += 1, one more credit                      │ yes
          │                         PolicyTrainer.step(groups)   (worker thread)
          │                         WeightSyncer.sync(step)      (worker thread, every sync_every)
          └── progress(version, issued) to generators ◄────────────┘
                                    eval / checkpoint every N steps; Event rows to controller

    The time budget also bounds admission (a run that only drops groups still ends). A step
    with a non-finite loss or gradient is skipped (no update, no sync), reported as a
    ``"skipped"`` row; more than ``error_budget`` of them end the run with the cause.
    At the end, each wait on a peer (the generators' drain, the stage before) lasts at most
    ``finish_timeout_s``; one that died is named in a :class:`RingError`, after a checkpoint.

    Heavy torch work runs in ``asyncio.to_thread``: the event loop keeps receiving groups and
    the generators keep their HTTP requests going while the trainer computes — that is where
    async mode's overlap comes from on a 2-core CPU (vLLM's worker is pinned to one core).
    """

    name = "trainer"
    sender = "reference"  # the stage that feeds the inlet
    timeout_field = "LLMConfig.finish_timeout_s"
    quiet_cancel = True  # cancelled while a worker thread computes

    def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any) -> None:
        from grpo_nb.llm import placement
        from grpo_nb.llm.trainer import load_policy
        from grpo_nb.weight_sync import WeightSyncer

        self.cfg, self.spec = cfg, spec
        self.finish_timeout_s = cfg.finish_timeout_s  # bounds each wait on a peer at the end
        self.attach(metrics)
        self.open_inlet()
        # Process-wide settings belong to the trainer's process (its own one on Monarch).
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.trainer_threads)
        model, tok = load_policy(spec.resume_dir or spec.model_dir,
                                 placement.trainer_device(cfg), placement.dtype_of(cfg))
        self.pt = PolicyTrainer(model, tok, cfg)
        resumed = self.pt.load(spec.resume_dir) if spec.resume_dir else {}
        # salted: the generators and the evaluation salt every request with its version
        self.syncer = WeightSyncer(spec.server_url, model, placement.sync_of(cfg),
                                   api_key=spec.api_key, salted=True)
        self.deadline: float | None = None  # time.time() at which the time budget runs out
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
        self.deadline = None if cfg.time_budget_s is None else t0 + cfg.time_budget_s
        while self.pt.step_count < cfg.steps and not self.stopping.is_set():
            groups = await self._collect(generators)
            if groups is None:  # stop requested, or the time budget ran out while waiting
                break
            start = time.time()
            row = await asyncio.to_thread(self.pt.step, groups)
            self.busy.add("train", start)
            if "skipped" in row:  # non-finite: weights unchanged, nothing to sync
                self._skipped(row)
                self.issued = self.received + (1 + ahead) * cfg.prompts_per_step
                self._progress(generators)
                continue
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

    def _skipped(self, row: dict[str, Any]) -> None:
        """Report a step skipped for a non-finite loss or gradient; past ``error_budget`` of
        them, stop: something is broken that more data will not fix."""
        self.report("skipped", step=row["step"], reason=row["skipped"],
                    total=row["skipped_steps"])
        if self.pt.skipped > self.cfg.error_budget:
            raise RingError(f"trainer: {self.pt.skipped} steps skipped for a non-finite loss "
                            f"or gradient (> LLMConfig.error_budget={self.cfg.error_budget}); "
                            f"last: {row['skipped']} at step {row['step'] + 1}")

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
        """The next message, or ``None`` as soon as a stop is requested or the time budget
        is spent. A receive still pending then is kept in ``next_msg``, so :meth:`_finish`
        loses nothing it brings."""
        left = None if self.deadline is None else self.deadline - time.time()
        if self.stopping.is_set() or (left is not None and left <= 0):
            return None
        if self.next_msg is None:
            self.next_msg = asyncio.ensure_future(self._receive())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:  # the time budget holds here too: admission may drop groups for a long while
            await asyncio.wait({self.next_msg, stop}, timeout=left,
                               return_when=asyncio.FIRST_COMPLETED)
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
                    bytes=res.bytes, verified=res.verified,
                    phases={k: round(v, 2) for k, v in res.phases.items()})

    async def _eval(self) -> None:
        """Greedy accuracy on the held-out prompts, sampled by the server (see evaluate.py)."""
        from grpo_nb.llm.evaluate import answer_checker, greedy_accuracy

        if self.pt.version != self.pt.step_count:
            await self._sync()  # evaluate the weights just trained, not the last synced ones
        start, spec = time.time(), self.spec
        async with CompletionsClient(spec.server_url + "/v1", spec.model_name,
                                     ClientConfig(max_in_flight=4, timeout_s=600.0, retries=2),
                                     api_key=spec.api_key) as client:
            res = await greedy_accuracy(client, spec.eval_prompts,
                                        answer_checker(spec.reward_default), self.cfg.max_tokens,
                                        cache_salt=policy_salt(self.pt.version))
        self.busy.add("eval", start)
        self.report("eval", step=self.pt.step_count, accuracy=res.accuracy, n=res.n,
                    truncated=res.truncated, version=self.pt.version, pid=os.getpid())

    def _checkpoint(self) -> None:
        if self.spec.run_dir is not None:
            self.pt.save(Path(self.spec.run_dir) / "checkpoint",
                         {"dropped": self.dropped, "received": self.received})

    async def _finish(self, generators: Any) -> None:
        try:
            leftover = await self._drain(generators)
        except RingError:
            await asyncio.to_thread(self._checkpoint)  # a dead peer must not cost the steps
            raise
        if self.pt.version != self.pt.step_count or self.pt.last_verified != self.pt.version:
            await self._sync(verify=True)  # the run ends on verified weights
        if self.pt.step_count % self.cfg.eval_every != 0:
            await self._eval()
        await asyncio.to_thread(self._checkpoint)
        self.busy.flush()  # before "exited": the controller stops listening then
        self.report("exited", actor=self.name, dropped=self.dropped, leftover=leftover,
                    steps=self.pt.step_count)

    async def _drain(self, generators: Any) -> int:
        """Drain the generators, then read up to the end of the stream: how many groups were
        left unused. Each wait on a peer is bounded (``finish_timeout_s``): a generator or
        stage that died raises :class:`RingError` naming it instead of hanging the run."""
        await self.drain_sources(generators, self.cfg.generators)
        pending, self.next_msg = self.next_msg, None
        first = await self.recv_within("the end of the stream", pending)
        return 0 if first is None else 1 + await self.discard_queued()

    async def __cleanup__(self, exc: Any) -> None:
        await super().__cleanup__(exc)
        await cancel_task(self.next_msg, quiet=True)
        self.syncer.close()
