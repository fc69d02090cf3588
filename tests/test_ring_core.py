"""The ring core both trainers keep (:class:`grpo_nb.ring_core.Ledger`): credits, staleness,
admission, and the ``admit`` hook that :meth:`grpo_nb.ring.Controller.start_ring` hands to the
trainer; and the trainer's process-wide torch settings, put back when it stops. No server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from llm_trainer import Credits, Null, built_trainer

from grpo_nb import partition
from grpo_nb.actors import endpoint
from grpo_nb.llm.config import LLMConfig
from grpo_nb.ring import Controller, Relay, Sink, Source
from grpo_nb.ring_core import Ledger, admit, issued, staleness

pytestmark = pytest.mark.timeout(60)


def off_by_one(step: int, group_version: int, max_staleness: int) -> bool:
    """A planted wrong rule (notebook 05's Exercise 2, nearly right): the bound itself refused."""
    return step - group_version < max_staleness


# ── the arithmetic ──


def test_credits_staleness_and_admission_rules() -> None:
    assert [issued(0, "async", 1, 16), issued(40, "async", 1, 16), issued(40, "sync", 2, 16),
            issued(10, "async", 2, 4)] == [32, 72, 56, 22]
    assert staleness(7, 5) == 2 and admit(7, 5, 2) and not admit(8, 5, 2) and admit(5, 5, 0)


def test_ledger_credits_every_drop_and_refills_after_a_step() -> None:
    rows: list[tuple[str, dict[str, Any]]] = []
    gens = Credits()
    ledger = Ledger("async", 1, 2, max_staleness=1, dynamic_sampling=True,
                    report=lambda kind, **data: rows.append((kind, data)))
    ledger.open(gens, 0)
    assert (ledger.issued, ledger.outstanding) == (4, 4)  # this step's 2 and 2 ahead
    fates = [ledger.take(3, v, r) for v, r in [(3, [0, 1]), (1, [0, 1]), (2, [1, 1]), (2, [0, 1])]]
    assert fates == [True, False, False, True]  # fresh; too stale; flat; admitted
    assert gens.totals == [4, 5, 6] and ledger.outstanding == 2  # each drop: one more credit
    assert rows == [("dropped", {"step": 3, "staleness": 2, "total": 1})]
    assert ledger.refill(4) == 4 + 4 and gens.told[-1] == (4, 8)
    assert ledger.state() == {"dropped": 1, "received": 4, "dynamic_dropped": 1}


def test_a_ledger_without_a_bound_admits_everything_and_refuses_a_rule() -> None:
    ledger = Ledger("sync", 3, 2)
    assert all(ledger.take(100, 0) for _ in range(3))
    with pytest.raises(ValueError, match="admit=.*needs max_staleness"):
        Ledger("sync", 0, 2, admit=off_by_one)
    from grpo_nb.toy.actors import Trainer
    from grpo_nb.toy.task import ToyConfig

    with pytest.raises(ValueError, match="needs max_staleness"):
        Trainer(ToyConfig(eval_states=4), Null(), off_by_one)


# ── the hook, through the wiring function: a planted rule changes what the ring admits ──


VERSIONS = [3, 1, 2, 3, 3]  # the groups' versions, in the order the generator makes them


class Gen(Source):
    def __init__(self, versions: list[int], out: Any, metrics: Any) -> None:
        self.versions, self.out = versions, out
        self.open_credits(1, metrics)

    @endpoint
    async def start(self) -> None:
        self.launch(self._produce())

    async def _produce(self) -> None:
        for v in self.versions:
            await self.credit()
            self.out.send(SimpleNamespace(policy_version=v, rewards=[0.0, 1.0]))
        await asyncio.Event().wait()


class Scorer(Relay):
    name = "scorer"

    def __init__(self, _versions: list[int], metrics: Any) -> None:
        self.open_inlet(metrics)

    async def process(self, msg: Any) -> Any:
        return msg


class Reference(Scorer):
    name = "reference"


class Taker(Sink):
    """A trainer at step 3 with max_staleness 1 that takes one step of 2 groups, then ends."""

    name = "trainer"

    def __init__(self, _versions: list[int], metrics: Any, admit: Any = None) -> None:
        self.open_inlet(metrics)
        self.ledger = Ledger("sync", 0, 2, max_staleness=1, admit=admit, report=self.report)

    @endpoint
    async def start(self, generators: Any) -> None:
        self.launch(self._train(generators))

    async def _train(self, generators: Any) -> None:
        self.ledger.open(generators, 3)
        kept = await self.collect(2, lambda g: self.ledger.take(3, g.policy_version, g.rewards))
        await self.drain_sources(generators, 1)
        self.report("exited", actor=self.name, kept=[g.policy_version for g in kept or []],
                    stale=self.ledger.stale, left=await self.discard_queued())


def _ring(rule: Any) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with Controller() as ctl:
            stages = {"generators": Gen, "scorer": Scorer, "reference": Reference,
                      "trainer": Taker}
            ring = await ctl.start_ring(stages, (VERSIONS,), generators=1, admit=rule)
            assert ring.trainer is not None and ring.generators is not None
            return (await ctl.relay({"trainer"}))["trainer"]

    return asyncio.run(main())


def test_the_admit_given_to_the_wiring_function_decides_what_the_ring_trains_on() -> None:
    # the library's rule: 3 (fresh) kept, 1 (2 stale) dropped, 2 (1 stale: the bound) kept
    assert _ring(None) | {"actor": None} == {"actor": None, "kept": [3, 2], "stale": 1, "left": 0}
    # the planted rule refuses the bound itself: 2 is dropped too, and a later 3 fills the step
    assert _ring(off_by_one) | {"actor": None} == {"actor": None, "kept": [3, 3], "stale": 2,
                                                    "left": 0}


def test_the_llm_trainer_applies_the_admit_it_is_built_with(random_model_dir) -> None:
    groups = [SimpleNamespace(policy_version=v, rewards=[0.0, 1.0]) for v in (2, 3, 3)]
    cfg = LLMConfig(prompts_per_step=2, max_staleness=1)
    kept = {}
    for name, rule in (("library", None), ("planted", off_by_one)):
        with built_trainer(random_model_dir, cfg, admit=rule, groups=groups, step=3) as t:
            got = asyncio.run(asyncio.wait_for(t.collect(2, t.keep), 10.0))
            kept[name] = ([g.policy_version for g in got], t.ledger.stale)
    assert kept == {"library": ([2, 3], 0), "planted": ([3, 3], 1)}


# ── the trainer's torch settings ──


def test_the_llm_trainer_puts_back_the_torch_threads_and_generator_it_changed(
        random_model_dir) -> None:
    """A notebook kernel that ran a trainer in-process keeps its own torch settings."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # not what the trainer sets (trainer_threads=1)
    torch.manual_seed(1234)
    rng = torch.random.get_rng_state()
    try:
        with built_trainer(random_model_dir, LLMConfig(trainer_threads=1, seed=7)):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 3
        assert torch.equal(torch.random.get_rng_state(), rng)
    finally:
        torch.set_num_threads(before)


def test_torch_settings_are_put_back_on_error_and_leave_the_generator_alone_without_seed():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError), partition.torch_settings(1, seed=0):
            assert torch.get_num_threads() == 1
            raise RuntimeError
        assert torch.get_num_threads() == 2
        with partition.torch_settings(1):
            drawn = torch.rand(1)
        assert not torch.equal(torch.rand(1), drawn)  # draws go on: no seed, no reset
    finally:
        torch.set_num_threads(before)
