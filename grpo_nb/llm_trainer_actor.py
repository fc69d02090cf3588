"""The ring's Trainer actor: admission, GRPO steps, weight sync, evaluation, checkpoints.

::

    inbox (scored groups) ──► admit? staleness = step − group.version ≤ max_staleness
          │ no: dropped += 1, one more credit                      │ yes
          │                                                        ▼
          │                         PolicyTrainer.step(groups)   (worker thread)
          │                                                        │ every sync_every steps
          │                         WeightSyncer.sync(step)  ──────┤ (worker thread; raises)
          └── progress(step, version, issued) to generators ◄──────┘
                                    eval / checkpoint every N steps; Event rows to controller

Heavy torch work runs in ``asyncio.to_thread``: the actor's event loop keeps receiving
groups and the generators keep their HTTP requests going while the trainer computes — that is
where async mode's overlap comes from on a 2-core CPU (vLLM's worker is pinned to one core).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from grpo_nb.llm_config import LLMConfig
from grpo_nb.llm_trainer import PolicyTrainer, ScoredGroup


def trainer_actor(api: ModuleType, stage: type) -> type:
    """The Trainer actor class for ``api``, built on the ring's shared ``_Stage`` base."""
    from grpo_nb.ring import Event

    class Trainer(stage):
        name = "trainer"

        def __init__(self, cfg: LLMConfig, spec: Any, metrics: Any) -> None:
            import torch

            from grpo_nb.tiny_model import load_hf
            from grpo_nb.weight_sync import WeightSyncer

            self.cfg, self.spec, self.metrics = cfg, spec, metrics
            torch.manual_seed(cfg.seed)
            model, tok = load_hf(spec.resume_dir or spec.model_dir)
            self.pt = PolicyTrainer(model, tok, cfg, spec.eval_prompts)
            self.resumed: dict[str, Any] = {}
            if spec.resume_dir:
                self.resumed = self.pt.load(spec.resume_dir)
            self.syncer = WeightSyncer(spec.server_url, model, cfg.sync)
            self.port, self.inbox = api.Channel.open()
            self.stop_requested = False
            self.issued = self.received = self.dropped = 0

        @api.endpoint
        async def inlet(self) -> Any:
            return self.port

        @api.endpoint
        async def start(self, generators: Any) -> None:
            self._launch(self._train(generators))

        @api.endpoint
        async def request_stop(self) -> None:
            """Finish the current step, then drain, sync, evaluate and checkpoint."""
            self.stop_requested = True

        def _progress(self, generators: Any) -> None:
            api.send(generators.progress, (self.pt.step_count, self.pt.version, self.issued), {},
                     selection="all")

        async def _sync(self, label: str = "sync", *, verify: bool | None = None) -> None:
            start = time.time()
            self.syncs = getattr(self, "syncs", 0) + 1
            if verify is None:
                verify = self.cfg.sync.verify and self.syncs % self.cfg.verify_every == 0
            res = await asyncio.to_thread(self.syncer.sync, self.pt.step_count, verify=verify)
            self.pt.version = res.version
            if res.verified:
                self.pt.last_verified = res.version
            self._busy(label, start)
            self.metrics.send(Event("sync", {"step": self.pt.step_count, "version": res.version,
                                             "ms": res.ms, "bytes": res.bytes,
                                             "verified": res.verified,
                                             "gap": self.syncer.last_gap}))

        async def _eval(self) -> None:
            start = time.time()
            acc = await asyncio.to_thread(self.pt.evaluate)
            self._busy("eval", start)
            self.metrics.send(Event("eval", {"step": self.pt.step_count, "accuracy": acc}))

        def _checkpoint(self) -> None:
            if self.spec.run_dir is not None:
                self.pt.save(Path(self.spec.run_dir) / "checkpoint",
                             {"dropped": self.dropped, "received": self.received})

        async def _next_admitted(self, generators: Any) -> ScoredGroup | None:
            """The next group fresh enough to train on (``None`` once stop is requested)."""
            cfg = self.cfg
            while not self.stop_requested:
                try:  # tick, so that a stop request is noticed while nothing arrives
                    group = await asyncio.wait_for(self.inbox.recv(), timeout=0.5)
                except TimeoutError:
                    continue
                self.received += 1
                if self.pt.step_count - group.version <= cfg.max_staleness:
                    return group
                self.dropped += 1
                self.issued += 1  # replace it, or the step would wait forever
                self._progress(generators)
                self.metrics.send(Event("dropped", {"step": self.pt.step_count,
                                                    "staleness": self.pt.step_count - group.version,
                                                    "total": self.dropped}))
            return None

        async def _train(self, generators: Any) -> None:
            import torch

            cfg = self.cfg
            torch.set_num_threads(cfg.trainer_threads)
            self.dropped = int(self.resumed.get("dropped", 0))
            await self._sync(verify=True)  # the server starts from the base model: align + check
            await self._eval()
            ahead = cfg.max_ahead if cfg.mode == "async" else 0
            self.issued = (1 + ahead) * cfg.prompts_per_step
            self._progress(generators)
            t0 = time.time()
            while self.pt.step_count < cfg.steps and not self.stop_requested:
                if cfg.time_budget_s is not None and time.time() - t0 > cfg.time_budget_s:
                    break
                groups: list[ScoredGroup] = []
                while len(groups) < cfg.prompts_per_step:
                    group = await self._next_admitted(generators)
                    if group is None:
                        break
                    groups.append(group)
                if len(groups) < cfg.prompts_per_step:
                    break
                start = time.time()
                row = await asyncio.to_thread(self.pt.step, groups)
                self._busy("train", start)
                now = time.time()
                row.update(staleness=[self.pt.step_count - 1 - g.version for g in groups],
                           age_s=[now - g.created for g in groups], dropped=self.dropped,
                           train_s=now - start, wall_s=now - t0, version=self.pt.version)
                self.metrics.send(Event("step", row))
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

        async def _finish(self, generators: Any) -> None:
            await generators.drain.call()
            leftover = 0
            while await self.inbox.recv() is not None:
                leftover += 1  # produced but never trained on
            if self.pt.version != self.pt.step_count or self.pt.last_verified != self.pt.version:
                await self._sync(verify=True)  # the run ends on verified weights
            if self.pt.step_count % self.cfg.eval_every != 0:
                await self._eval()
            await asyncio.to_thread(self._checkpoint)
            self.metrics.send(Event("exited", {"actor": self.name, "dropped": self.dropped,
                                               "leftover": leftover,
                                               "steps": self.pt.step_count}))

        async def __cleanup__(self, exc: Any) -> None:
            await super().__cleanup__(exc)
            self.syncer.close()

    return Trainer
