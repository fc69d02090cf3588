"""Acceptance: Monarch's ``grpo_yield.py`` example, retold in our words, on both runtimes.

The ring (generators → scorer → reference → trainer, weights back to one generator with
``send(..., selection="choose")``, drain + ``None`` sentinel, then ``stop()``) is written once
in :func:`build_ring` against an API module ``api``. The only thing that differs between the
two parametrized runs is which module that is — the equivalent of changing the import line
``from grpo_nb.actors import ...`` to ``from monarch.actor import ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributions import Categorical

import grpo_nb.actors

OBS, ARMS, WIDTH, GROUP, POOL, STEPS, CLIP, BETA = 4, 4, 8, 8, 4, 20, 0.2, 0.05


@dataclass
class Sample:
    obs: torch.Tensor
    acts: torch.Tensor
    logp: torch.Tensor
    reward: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


def policy_net() -> nn.Module:
    return nn.Sequential(nn.Linear(OBS, WIDTH), nn.Tanh(), nn.Linear(WIDTH, ARMS))


def build_ring(api: ModuleType) -> SimpleNamespace:
    """The four actor classes, written against ``api`` (grpo_nb.actors or monarch.actor)."""

    class Gen(api.Actor):
        def __init__(self, out):
            self.net, self.out = policy_net(), out
            self.inbox: asyncio.Queue = asyncio.Queue()
            self.loop_task = None

        @api.endpoint
        async def start(self) -> None:
            self.loop_task = asyncio.create_task(self.produce())

        async def produce(self) -> None:
            while True:
                while not self.inbox.empty():  # newest weights win
                    self.net.load_state_dict(self.inbox.get_nowait())
                obs = torch.randn(OBS)
                with torch.no_grad():
                    dist = Categorical(logits=self.net(obs))
                    acts = dist.sample((GROUP,))
                    self.out.send(Sample(obs, acts, dist.log_prob(acts)))
                await asyncio.sleep(0)

        @api.endpoint
        async def update_weights(self, state: dict) -> None:
            await self.inbox.put(state)

        @api.endpoint
        async def drain(self) -> None:
            await self.halt()
            self.out.send(None)

        async def halt(self) -> None:
            if self.loop_task is not None and not self.loop_task.done():
                self.loop_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.loop_task

        async def __cleanup__(self, exc) -> None:
            await self.halt()

    class Relay(api.Actor):
        """Receives samples, fills in one field (``fill``), passes them on; ``None`` ends it."""

        def __init__(self):
            self.port, self.inbox = api.Channel.open()

        @api.endpoint
        async def inlet(self):
            return self.port

        @api.endpoint
        async def run(self, out) -> None:
            while (s := await self.inbox.recv()) is not None:
                with torch.no_grad():
                    self.fill(s)
                out.send(s)
            out.send(None)

    class Score(Relay):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.judge = nn.Sequential(nn.Linear(OBS + 1, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

        def fill(self, s: Sample) -> None:
            feats = torch.cat([s.obs.expand(GROUP, OBS), s.acts.float()[:, None]], dim=-1)
            s.reward = self.judge(feats).squeeze(-1)

    class Ref(Relay):
        def __init__(self, state: dict):
            super().__init__()
            self.net = policy_net()
            self.net.load_state_dict(state)

        def fill(self, s: Sample) -> None:
            s.ref_logp = Categorical(logits=self.net(s.obs)).log_prob(s.acts)

    class Learn(api.Actor):
        def __init__(self, steps: int, done):
            self.net = policy_net()
            self.opt = torch.optim.Adam(self.net.parameters(), lr=0.05)
            self.port, self.inbox = api.Channel.open()
            self.steps, self.done = steps, done

        @api.endpoint
        async def inlet(self):
            return self.port

        @api.endpoint
        async def snapshot(self) -> dict:
            return copy.deepcopy(self.net.state_dict())

        @api.endpoint
        async def run(self, gens) -> None:
            for _ in range(self.steps):
                s = await self.inbox.recv()
                adv = (s.reward - s.reward.mean()) / (s.reward.std() + 1e-8)
                logp = Categorical(logits=self.net(s.obs)).log_prob(s.acts)
                ratio = (logp - s.logp).exp()
                surrogate = torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
                loss = -surrogate.mean() + BETA * (logp - s.ref_logp).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                api.send(
                    gens.update_weights,
                    (copy.deepcopy(self.net.state_dict()),),
                    {},
                    selection="choose",
                )
            await gens.drain.call()
            self.done.send(self.steps)

    return SimpleNamespace(Gen=Gen, Score=Score, Ref=Ref, Learn=Learn)


async def run_ring(api: ModuleType, steps: int = STEPS) -> int:
    ring = build_ring(api)
    host = api.this_host()
    procs = [host.spawn_procs(per_host={"gpus": n}) for n in (POOL, 1, 1, 1)]
    done, finished = api.Channel.open(once=True)
    learner = procs[3].spawn("learn", ring.Learn, steps, done)
    start_state = await learner.snapshot.call_one()
    scorer = procs[1].spawn("score", ring.Score)
    gens = procs[0].spawn("gen", ring.Gen, await scorer.inlet.call_one())
    ref = procs[2].spawn("ref", ring.Ref, start_state)
    await gens.start.call()
    loops = [
        scorer.run.call_one(await ref.inlet.call_one()),
        ref.run.call_one(await learner.inlet.call_one()),
        learner.run.call_one(gens),
    ]
    last = await finished.recv()
    for fut in loops:
        await fut
    await gens.stop()
    for pm in procs:
        await pm.stop()
    return last


@pytest.mark.parametrize(
    "runtime",
    ["asyncio", pytest.param("monarch", marks=[pytest.mark.monarch, pytest.mark.slow])],
)
def test_seed_ring_completes_and_shuts_down(runtime: str) -> None:
    if runtime == "monarch" and not grpo_nb.actors.monarch_available():
        pytest.fail("torchmonarch is not importable; deselect with -m 'not monarch'")
    api = grpo_nb.actors.backend(runtime)
    if runtime == "monarch":
        import sys

        import cloudpickle

        # Monarch's worker processes cannot import this test file: ship its code by value,
        # as Monarch already does for classes defined in a notebook.
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # torch imports its compiler stack on the first optimizer (seconds on a busy CPU): a one-time
    # cost of the process, not of the ring, so pay it before the clock starts.
    torch.optim.Adam(policy_net().parameters())
    t0 = time.perf_counter()
    last = asyncio.run(asyncio.wait_for(run_ring(api), timeout=300))
    elapsed = time.perf_counter() - t0
    assert last == STEPS
    limit = 10.0 if runtime == "asyncio" else 240.0  # Monarch starts 7 processes: a hang guard
    assert elapsed < limit, f"{runtime}: ring took {elapsed:.1f}s"
