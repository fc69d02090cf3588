"""Bounded waits at the end of a ring: a peer that died or never sends its end of stream
(``None``) ends the run with a :class:`RingError` naming it and the time waited, never a hang.

No vLLM server: the asyncio actor runtime, fake peers, the toy ring, and the LLM trainer's
finish path on a trainer built on a random model. ``pytest-timeout`` turns a hang (a bound
removed) into a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from grpo_nb import ring
from grpo_nb.actors import current_rank, endpoint
from grpo_nb.ring import Controller, Relay, RingError, Sink, Source

pytestmark = pytest.mark.timeout(30)

BOUND = 0.3  # seconds: every test below finishes in a few of these when the bounds hold


class Tail(Sink):
    """A ring's last stage reduced to its finish path: drain the sources, discard the rest."""

    name, sender = "tail", "fake-reference"
    finish_timeout_s = BOUND

    def __init__(self, metrics: Any) -> None:
        self.open_inlet(metrics)

    @endpoint
    async def finish(self, sources: Any = None, count: int = 0) -> None:
        self.launch(self._finish(sources, count))

    async def _finish(self, sources: Any, count: int) -> None:
        if sources is not None:
            await self.drain_sources(sources, count)
        self.report("exited", actor=self.name, left=await self.discard_queued())


class Pass(Relay):
    name, sender, upstream = "pass", "the fake generators", 2
    finish_timeout_s = BOUND

    def __init__(self, metrics: Any) -> None:
        self.open_inlet(metrics)

    async def process(self, msg: Any) -> Any:
        return msg


class FakeGen(Source):
    """Drains like a real source, except the rank in ``hang`` never answers its drain."""

    def __init__(self, out: Any, metrics: Any, hang: int | None = None) -> None:
        self.out, self.hang = out, hang
        self.name = f"gen{current_rank().rank}"
        self.attach(metrics)

    @endpoint
    async def drain(self) -> None:
        if current_rank().rank == self.hang:
            await asyncio.Event().wait()  # a peer stuck for ever
        self.out.send(None)


async def _relay_until(ctl: Controller, actor: str) -> dict[str, Any]:
    return await ctl.relay({actor})


def test_discard_names_the_silent_sender_and_the_time_instead_of_hanging():
    async def main() -> None:
        async with Controller() as ctl:
            tail = ctl.spawn(ctl.procs(here=True), "tail", Tail, ctl.metrics)
            inlet = await tail.inlet.call_one()
            inlet.send("a")
            inlet.send("b")  # ... and never the None that ends the stream
            await tail.finish.call_one()
            with pytest.raises(RingError) as err:
                await _relay_until(ctl, "tail")
        msg = str(err.value)
        assert "tail: nothing from fake-reference for 0." in msg
        assert f"(finish_timeout_s={BOUND:g})" in msg and "(2 discarded)" in msg

    asyncio.run(main())


def test_discard_still_counts_up_to_the_end_of_the_stream():
    async def main() -> dict[str, Any]:
        async with Controller() as ctl:
            tail = ctl.spawn(ctl.procs(here=True), "tail", Tail, ctl.metrics)
            inlet = await tail.inlet.call_one()
            for msg in ("a", "b", None):
                inlet.send(msg)
            await tail.finish.call_one()
            return await _relay_until(ctl, "tail")

    assert asyncio.run(main())["tail"]["left"] == 2


def test_relay_waits_freely_while_running_but_bounds_the_senders_after_the_first_end():
    async def main() -> None:
        async with Controller() as ctl:
            relay = ctl.spawn(ctl.procs(here=True), "pass", Pass, ctl.metrics)
            out, inbox = ctl.api.Channel.open()
            await relay.start.call_one(out)
            inlet = await relay.inlet.call_one()
            await asyncio.sleep(3 * BOUND)  # silence while running is not a fault
            inlet.send("x")
            inlet.send(None)  # one sender ends; the other never does
            with pytest.raises(RingError) as err:
                await _relay_until(ctl, "pass")
            assert await inbox.recv() == "x"  # what came before was relayed
        msg = str(err.value)
        assert "pass: nothing from the fake generators for 0." in msg
        assert "1 more end(s) of stream (1 of 2 senders ended)" in msg

    asyncio.run(main())


def test_the_llm_scorer_takes_its_bound_and_its_name_from_the_config():
    from grpo_nb.llm.actors import Scorer
    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.llm.data import RingSpec

    async def main() -> None:
        async with Controller() as ctl:
            cfg = LLMConfig(generators=2, finish_timeout_s=0.2)
            scorer = ctl.spawn(ctl.procs(here=True), "scorer", Scorer, cfg,
                               RingSpec("http://unused", "m", "unused", []), ctl.metrics)
            out, _ = ctl.api.Channel.open()
            await scorer.start.call_one(out)
            (await scorer.inlet.call_one()).send(None)  # one generator ends, the other never
            with pytest.raises(RingError, match=r"\(LLMConfig.finish_timeout_s=0.2\)"):
                await _relay_until(ctl, "scorer")

    asyncio.run(main())


def test_drain_names_the_source_that_does_not_answer():
    async def main() -> None:
        async with Controller() as ctl:
            tail = ctl.spawn(ctl.procs(here=True), "tail", Tail, ctl.metrics)
            gens = ctl.spawn(ctl.procs(3), "gens", FakeGen, await tail.inlet.call_one(),
                             ctl.metrics, 1)
            await tail.finish.call_one(gens, 3)
            with pytest.raises(RingError) as err:
                await _relay_until(ctl, "tail")
        msg = str(err.value)
        assert "tail: gen1 did not finish draining within 0." in msg
        assert "gen0" not in msg and "gen2" not in msg

    asyncio.run(main())


# ── the toy ring, end to end, with one generator that misbehaves at drain ──


def _toy_with(monkeypatch: pytest.MonkeyPatch, generator: type) -> str:
    from grpo_nb.toy import run as toy_run
    from grpo_nb.toy.task import ToyConfig

    monkeypatch.setattr(toy_run, "Generator", generator)
    monkeypatch.setattr(ring.Sink, "finish_timeout_s", BOUND)  # the toy's stages' default
    cfg = replace(ToyConfig(), steps=3, generators=2, eval_states=16)
    with pytest.raises(RingError) as err:
        asyncio.run(toy_run.run_ring(cfg))
    return str(err.value)


def _toy_generator(kind: str) -> type:
    from grpo_nb.toy.actors import Generator

    class Broken(Generator):
        @endpoint
        async def drain(self) -> None:
            if current_rank().rank == 1:
                if kind == "hang":
                    await asyncio.Event().wait()
                await self.stop_loop()  # "silent": stops, but never sends its None
                return
            await super().drain()

    return Broken


def test_toy_ring_names_a_generator_that_never_ends_its_stream(monkeypatch):
    msg = _toy_with(monkeypatch, _toy_generator("silent"))
    assert "scorer: nothing from the generators" in msg
    assert "(1 of 2 senders ended)" in msg


def test_toy_ring_names_a_generator_whose_drain_hangs(monkeypatch):
    msg = _toy_with(monkeypatch, _toy_generator("hang"))
    assert "trainer: gen1 did not finish draining" in msg


# ── the LLM trainer's finish path (a trainer built on a random model, no server) ──


@contextlib.contextmanager
def _llm_trainer(model_dir: Any, saved: list[str]) -> Iterator[Any]:
    """A :class:`grpo_nb.llm.actors.Trainer` whose checkpoints are only recorded in ``saved``."""
    from llm_trainer import built_trainer

    from grpo_nb.llm.config import LLMConfig

    with built_trainer(model_dir, LLMConfig(generators=2, finish_timeout_s=BOUND)) as t:
        t.learner.save = lambda state: saved.append("checkpoint")
        yield t


@pytest.mark.timeout(120)  # builds a model: slower on a loaded machine
def test_llm_trainer_finish_is_bounded_names_the_peer_and_keeps_the_steps(random_model_dir):
    from grpo_nb.actors import Channel, this_host

    async def main(t: Any, saved: list[str]) -> None:
        to_scorer, _ = Channel.open()  # a scorer that never forwards the end of the stream
        gens = this_host().spawn_procs(per_host={"gpus": 2}).spawn(
            "gens", FakeGen, to_scorer, _Null(), None)
        t.port.send("group")  # and never the None the reference should have forwarded
        with pytest.raises(RingError) as err:
            await t._finish(gens)
        msg = str(err.value)
        assert "trainer: nothing from reference for 0." in msg
        assert f"(LLMConfig.finish_timeout_s={BOUND:g})" in msg
        assert saved == ["checkpoint"]  # a dead peer does not cost the trained steps
        await gens.stop()

    saved: list[str] = []
    with _llm_trainer(random_model_dir, saved) as t:
        asyncio.run(main(t, saved))


@pytest.mark.timeout(120)  # builds a model: slower on a loaded machine
def test_llm_trainer_bounds_a_receive_pending_since_the_stop_and_the_drain(random_model_dir):
    from grpo_nb.actors import Channel, this_host

    async def main(t: Any) -> None:
        t.next_msg = asyncio.ensure_future(asyncio.Event().wait())  # never resolves
        to_scorer, _ = Channel.open()
        quiet = this_host().spawn_procs(per_host={"gpus": 2}).spawn(
            "gens", FakeGen, to_scorer, _Null(), None)
        with pytest.raises(RingError, match="while waiting for the end of the stream"):
            await t._finish(quiet)
        hung = this_host().spawn_procs(per_host={"gpus": 2}).spawn(
            "gens", FakeGen, to_scorer, _Null(), 0)
        with pytest.raises(RingError, match=r"trainer: gen0 did not finish draining"):
            await t._finish(hung)
        await quiet.stop()
        await hung.stop()

    with _llm_trainer(random_model_dir, []) as t:
        asyncio.run(main(t))


def test_finish_timeout_is_validated_by_name():
    from grpo_nb.llm.config import LLMConfig

    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="LLMConfig.finish_timeout_s"):
            LLMConfig(finish_timeout_s=bad)


class _Null:
    """A metrics port that drops what it is sent."""

    def send(self, _event: Any) -> None:
        pass


# ── a group taken off the inlet must not be lost to a cancelled receive ──


def test_a_group_that_arrives_as_a_stop_comes_is_kept_not_lost():
    """A receive cancelled by a stop-polling timeout may already have taken a group off the
    queue; in sync mode exactly one step's groups are issued, so the trainer would then wait
    for ever. :meth:`Sink.collect` never cancels a receive under way: it keeps it
    (``next_msg``) for the finish."""
    from types import SimpleNamespace

    async def main() -> None:
        t, stopping = Tail(_Null()), asyncio.Event()
        got: list[Any] = []
        for i in range(24):  # the stop lands a few loop passes before, with, or after the group
            waiting = asyncio.ensure_future(t.collect(1, lambda g: True, stopping=stopping))
            for _ in range(i % 3):
                await asyncio.sleep(0)
            group = SimpleNamespace(policy_version=0, name=f"group{i}")
            events = [stopping.set, lambda g=group: t.port.send(g)]
            if i % 2:
                events.reverse()
            events[0]()
            for _ in range(i // 6):
                await asyncio.sleep(0)
            events[1]()
            msg = await waiting
            if msg is None and t.next_msg is not None:  # the stop won a receive under way:
                msg, t.next_msg = [await t.next_msg], None  # it must still bring the group
            elif msg is None:  # the stop came before any receive: the group is still queued
                assert t.inbox.qsize() == 1, f"group{i} was lost with its receive"
                msg = [await t.inbox.recv()]
            got.append(msg[0].name)
            stopping.clear()
        assert got == [f"group{i}" for i in range(24)] and t.inbox.qsize() == 0

    asyncio.run(main())


def test_the_finish_reads_a_receive_left_pending_before_the_queue():
    """:meth:`Sink.discard_queued` counts what the receive a stop left pending brings too."""

    async def main() -> int:
        t, stopping = Tail(_Null()), asyncio.Event()
        stopping.set()
        t.next_msg = asyncio.ensure_future(t.inbox.recv())  # as collect leaves it at a stop
        assert await t.collect(1, lambda g: True, stopping=stopping) is None
        for msg in ("a", "b", None):
            t.port.send(msg)
        return await t.discard_queued()

    assert asyncio.run(main()) == 2
