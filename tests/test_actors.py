"""Semantics of grpo_nb.actors that torchmonarch also has (one process, asyncio)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import torch

from grpo_nb.actors import (
    Actor,
    ActorError,
    Channel,
    concurrent_endpoint,
    current_rank,
    endpoint,
    send,
    this_host,
    this_proc,
)


class Sleeper(Actor):
    def __init__(self) -> None:
        self.calls = 0
        self.inside = self.peak = 0  # naps running now, and at most so far

    async def _nap(self, seconds: float) -> None:
        self.inside += 1
        self.peak = max(self.peak, self.inside)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.inside -= 1

    @endpoint
    async def nap(self, seconds: float) -> int:
        self.calls += 1
        await self._nap(seconds)
        return current_rank().rank

    @concurrent_endpoint
    async def nap_together(self, seconds: float) -> float:
        await self._nap(seconds)
        return seconds

    @endpoint
    async def take_peak(self) -> int:
        """The most naps that ran at once since the last call."""
        peak, self.peak = self.peak, 0
        return peak

    @endpoint
    async def fail(self) -> None:
        def deep_inside() -> None:
            raise KeyError("the original problem")

        deep_inside()

    @endpoint
    async def keep(self, value: list) -> list:
        self.kept = value
        return self.kept

    @endpoint
    async def kept_value(self) -> list:
        return self.kept


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_one_message_at_a_time_unless_concurrent() -> None:
    async def main() -> tuple[float, int, int]:
        actor = this_proc().spawn("s", Sleeper)
        t0 = time.perf_counter()
        await asyncio.gather(actor.nap.call_one(0.3), actor.nap.call_one(0.3))
        serial = time.perf_counter() - t0
        alone = await actor.take_peak.call_one()
        await asyncio.gather(actor.nap_together.call_one(1.0), actor.nap_together.call_one(1.0))
        together = await actor.take_peak.call_one()
        await actor.stop()
        return serial, alone, together

    serial, alone, together = run(main())
    assert serial >= 0.58 and alone == 1, "two plain endpoint calls on one actor must not overlap"
    assert together == 2, "concurrent_endpoint calls should overlap"


def test_call_call_one_choose_broadcast() -> None:
    async def main() -> None:
        mesh = this_host().spawn_procs(per_host={"gpus": 3}).spawn("s", Sleeper)
        values = await mesh.nap.call(0)
        assert sorted(values.values()) == [0, 1, 2]
        assert [p.rank for p, _ in values.items()] == [0, 1, 2]
        assert values.item(gpus=2) == 2
        with pytest.raises(ValueError, match="exactly 1 actor"):
            mesh.nap.call_one(0)
        assert await mesh.nap.choose(0) in {0, 1, 2}
        mesh.nap.broadcast(0)
        await asyncio.sleep(0.05)
        await mesh.stop()

    run(main())


def test_actor_error_carries_remote_traceback() -> None:
    async def main() -> None:
        actor = this_proc().spawn("s", Sleeper)
        with pytest.raises(ActorError) as info:
            await actor.fail.call_one()
        assert isinstance(info.value.exception, KeyError)
        assert "deep_inside" in str(info.value) and "the original problem" in str(info.value)
        await actor.stop()

    run(main())


def test_fire_and_forget_failure_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        mesh = this_host().spawn_procs(per_host={"gpus": 2}).spawn("s", Sleeper)
        with caplog.at_level(logging.ERROR, logger="grpo_nb.actors"):
            send(mesh.fail, (), {}, selection="choose")
            mesh.fail.broadcast()
            await asyncio.sleep(0.1)
        assert caplog.text.count("unhandled error in fire-and-forget s.fail") == 3
        assert caplog.text.count("KeyError: 'the original problem'") == 3, "each line has the error"
        await mesh.stop()

    run(main())


def test_send_with_port_collects_results_and_errors() -> None:
    async def main() -> None:
        mesh = this_host().spawn_procs(per_host={"gpus": 2}).spawn("s", Sleeper)
        port, receiver = Channel.open()
        send(mesh.nap, (0,), {}, port=port)
        assert sorted([await receiver.recv(), await receiver.recv()]) == [0, 1]
        send(mesh.fail, (), {}, port=port, selection="choose")
        with pytest.raises(ActorError, match="deep_inside"):  # the remote traceback travels too
            await receiver.recv()
        with pytest.raises(ValueError, match="selection"):
            send(mesh.nap, (0,), {}, selection="some")
        await mesh.stop()

    run(main())


def test_ports_are_ordered_copied_and_once() -> None:
    async def main() -> None:
        port, receiver = Channel.open()
        payload = [torch.zeros(2)]
        for i in range(50):
            port.send(i)
        port.send(payload)
        payload[0] += 1  # the sender changes its object after sending
        assert [await receiver.recv() for _ in range(50)] == list(range(50))
        got = await receiver.recv()
        assert torch.equal(got[0], torch.zeros(2)), "receiver must see the value at send time"
        port.exception(RuntimeError("stop"))
        with pytest.raises(RuntimeError, match="stop"):
            await receiver.recv()
        once, once_recv = Channel.open(once=True)
        once.send(1)
        with pytest.raises(ValueError, match="once"):
            once.send(2)
        assert await once_recv.recv() == 1

    run(main())


class Unsendable(Actor):
    @endpoint
    async def lock(self) -> object:
        return threading.Lock()

    @endpoint
    async def raise_lock(self) -> None:
        raise RuntimeError(threading.Lock())

    @endpoint
    async def ok(self) -> int:
        return 1


def test_unpicklable_result_or_error_reaches_the_caller_and_the_actor_lives_on() -> None:
    async def main() -> None:
        actor = this_proc().spawn("u", Unsendable)
        for method in (actor.lock, actor.raise_lock):
            with pytest.raises(ActorError, match="cannot be sent"):
                await asyncio.wait_for(_await(method.call_one()), 5)
        assert await asyncio.wait_for(_await(actor.ok.call_one()), 5) == 1
        await actor.stop()

    run(main())


def test_actors_share_no_memory() -> None:
    async def main() -> None:
        actor = this_proc().spawn("s", Sleeper)
        mine = [1, 2]
        returned = await actor.keep.call_one(mine)
        mine.append(3)
        returned.append(4)
        assert await actor.kept_value.call_one() == [1, 2]
        await actor.stop()

    run(main())


class Cleaner(Actor):
    def __init__(self, log: object) -> None:
        self.log = log

    @endpoint
    async def forever(self) -> None:
        await asyncio.sleep(3600)

    async def __cleanup__(self, exc: Exception | None) -> None:
        self.log.send(("cleanup", exc, current_rank().rank))


def test_stop_cancels_runs_cleanup_and_refuses_later_calls() -> None:
    async def main() -> None:
        log, log_recv = Channel.open()
        actor = this_proc().spawn("c", Cleaner, log)
        running = asyncio.ensure_future(_await(actor.forever.call_one()))
        queued = asyncio.ensure_future(_await(actor.forever.call_one()))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        await actor.stop()
        assert time.perf_counter() - t0 < 30.0  # a hang guard: forever sleeps an hour
        assert await log_recv.recv() == ("cleanup", None, 0)  # run as the actor, at its rank
        for fut in (running, queued):
            with pytest.raises(ActorError):
                await fut
        with pytest.raises(ActorError, match="stopped"):
            await actor.forever.call_one()

    run(main())


async def _await(fut):
    return await fut


def test_class_rules_match_monarch() -> None:
    class Mixed(Actor):
        @endpoint
        async def a(self) -> None: ...

        @endpoint
        def b(self) -> None: ...

    class Shadow(Actor):
        @endpoint
        async def stop(self) -> None: ...

    class SyncCleanup(Actor):
        @endpoint
        async def a(self) -> None: ...

        def __cleanup__(self, exc: Exception | None) -> None: ...

    for cls, match in ((Mixed, "mixes"), (Shadow, "shadow"), (SyncCleanup, "__cleanup__")):
        with pytest.raises(ValueError, match=match):
            this_proc().spawn("x", cls)
    with pytest.raises(TypeError):

        class Bad(Actor):
            @concurrent_endpoint
            def sync(self) -> None: ...


class Ping(Actor):
    def __init__(self, pong: object) -> None:
        self.pong = pong

    @endpoint
    async def rally(self, me: object) -> str:
        return await self.pong.reply.call_one(me)

    @endpoint
    async def ack(self) -> str:
        return "ack"



class Pong(Actor):
    @endpoint
    async def reply(self, ping: object) -> str:
        return await ping.ack.call_one()


def test_call_back_into_a_busy_actor_deadlocks_unless_concurrent() -> None:
    async def main() -> None:
        procs = this_proc()
        pong = procs.spawn("pong", Pong)
        ping = procs.spawn("ping", Ping, pong)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_await(ping.rally.call_one(ping)), 0.5)
        await ping.stop()
        await pong.stop()

        class FixedPing(Ping):
            # The fix: the endpoint that waits lets the actor take other messages meanwhile.
            @concurrent_endpoint
            async def rally(self, me: object) -> str:
                return await self.pong.reply.call_one(me)

        pong = procs.spawn("pong", Pong)
        ping = procs.spawn("ping", FixedPing, pong)
        assert await asyncio.wait_for(_await(ping.rally.call_one(ping)), 5) == "ack"
        await ping.stop()
        await pong.stop()

    run(main())


def test_future_get_from_sync_code_and_refused_inside_a_loop() -> None:
    actor = this_proc().spawn("s", Sleeper)
    assert actor.nap.call_one(0).get(timeout=5) == 0
    actor.stop().get(timeout=5)

    async def inside() -> None:
        a = this_proc().spawn("s", Sleeper)
        with pytest.raises(RuntimeError, match="await"):
            a.nap.call_one(0).get()
        await a.stop()

    run(inside())


def test_init_failure_reaches_the_caller() -> None:
    class Broken(Actor):
        def __init__(self) -> None:
            raise OSError("no such device")

        @endpoint
        async def hello(self) -> None: ...

    async def main() -> None:
        mesh = this_proc().spawn("b", Broken)
        with pytest.raises(ActorError, match="no such device"):
            await mesh.hello.call_one()
        await mesh.stop()

    run(main())
