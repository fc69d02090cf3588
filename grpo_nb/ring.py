"""The skeleton both GRPO rings are built on: a stage's background loop and crash report, the
three ring positions (with credits, the trainers' collection of a step and a bounded two-phase
shutdown), and the :class:`Controller` that spawns and wires (:meth:`Controller.start_ring`),
watches and stops the stages. The trainers' credits and admission: :mod:`grpo_nb.ring_core`.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_nb.actors import Actor, Channel, backend, class_for, current_rank, endpoint
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.ring_core import Admit


@dataclass
class Event:
    """What actors tell the controller: ``"busy"``, ``"exited"``, ``"error"`` or a row kind."""

    kind: str
    data: Any


class RingError(RuntimeError):
    """A ring actor failed; the message carries its name and traceback."""


async def cancel_task(task: asyncio.Future | None, *, quiet: bool = False) -> None:
    """Cancel ``task`` and wait for it; ``quiet`` also swallows an error raised while it unwinds."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, *((Exception,) if quiet else ())):
            await task


class Busy:
    """Collects an actor's busy intervals (wall-clock seconds) and ships them in batches."""

    def __init__(self, actor: str, metrics: Any, flush_every_s: float = 0.2) -> None:
        self.actor, self.metrics, self.flush_every_s = actor, metrics, flush_every_s
        self.rows: list[tuple[str, str, float, float]] = []
        self.last_flush = time.time()

    def add(self, label: str, start: float) -> None:
        end = time.time()
        self.rows.append((self.actor, label, start, end))
        if end - self.last_flush > self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.metrics.send(Event("busy", self.rows))
            self.rows = []
        self.last_flush = time.time()


class Stage(Actor):
    """Base of every ring actor: a background loop (:meth:`launch`) that reports its crash."""

    name = "stage"
    quiet_cancel = False  # True: an exception while the loop unwinds after cancel is ignored

    def attach(self, metrics: Any) -> None:
        self.metrics, self.busy = metrics, Busy(self.name, metrics)

    def report(self, kind: str, **data: Any) -> None:
        self.metrics.send(Event(kind, data))

    def launch(self, coro: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.create_task(self._guard(coro))

    async def _guard(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except Exception as err:  # not CancelledError: a cancel is how a loop ends
            self.busy.flush()  # before "error": the controller stops listening then
            self.report("error", actor=self.name, error=repr(err), traceback=traceback.format_exc())
        finally:
            self.busy.flush()

    async def stop_loop(self) -> None:
        await cancel_task(getattr(self, "_task", None), quiet=self.quiet_cancel)

    async def __cleanup__(self, exc: Any) -> None:
        await self.stop_loop()


class Source(Stage):
    """The ring's start (generators): produces into ``out`` as many groups as the trainer's
    credits allow (its :meth:`progress`), until the trainer drains it."""

    out: Any

    def open_credits(self, generators: int, metrics: Any) -> None:
        """Attach as ``gen<rank>``, one of ``generators`` sharing the credits; none yet."""
        self.rank, self.generators = current_rank().rank, generators
        self.name = f"gen{self.rank}"
        self.attach(metrics)
        self.trainer_version = self.allowed = self.made = 0
        self.changed = asyncio.Event()

    @endpoint
    async def progress(self, version: int, issued: int) -> None:
        """The trainer's weight version, and how many groups the whole ring may have issued: this
        source may make its share, ``issued`` split as evenly as possible over the sources."""
        self.trainer_version = version
        self.allowed = issued // self.generators + int(self.rank < issued % self.generators)
        self.changed.set()

    async def credit(self, running: set[asyncio.Task] | None = None, slots: int = 1) -> None:
        """Wait for a credit and (with ``running``, its groups in flight) a free slot, then take
        it; a group task that failed meanwhile raises its error here."""
        running = set() if running is None else running
        while self.made >= self.allowed or len(running) >= slots:
            self.changed.clear()
            waiter = asyncio.ensure_future(self.changed.wait())
            try:
                done, _ = await asyncio.wait([waiter, *running], return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when cancelled: no pending task left behind
                waiter.cancel()
            for task in done & running:
                running.discard(task)
                task.result()
        self.made += 1

    @endpoint
    async def drain(self) -> None:
        """Stop producing, then tell the next stage this source is done (one ``None``)."""
        await self.stop_loop()  # its busy rows are flushed as the loop ends
        self.out.send(None)


class Sink(Stage):
    """A stage with an inlet (:meth:`inlet` hands its port to the stage before it): the base of
    the middle stages (:class:`Relay`) and of the ring's end (the trainers, which take each
    step's groups with :meth:`collect`). Its waits while the ring ends (:meth:`drain_sources`,
    :meth:`recv_within`, :meth:`discard_queued`) are bounded by ``finish_timeout_s``, so a dead
    or stuck peer ends the run with a RingError naming it."""

    finish_timeout_s = 60.0  # the bound (a stage may set it from its config)
    timeout_field = "finish_timeout_s"  # the bound's setting, named in the error
    sender = "upstream"  # who feeds the inlet, for error messages
    next_msg: asyncio.Future | None = None  # a receive :meth:`collect` left pending at a stop

    def open_inlet(self, metrics: Any) -> None:
        """Attach, and open the inlet that :meth:`inlet` hands to the stage before this one."""
        self.attach(metrics)
        self.port, self.inbox = Channel.open()

    @endpoint
    async def inlet(self) -> Any:
        return self.port

    async def collect(self, count: int, keep: Callable[[Any], bool], *,
                      stopping: asyncio.Event | None = None,
                      deadline: float | None = None) -> list[Any] | None:
        """The next ``count`` messages that ``keep`` accepts (it counts, and credits, what it
        drops), or ``None`` once ``stopping`` is set, ``deadline`` (a ``time.time()``) passes or
        the stream ends. A receive then pending stays in ``next_msg`` for
        :meth:`discard_queued`: cancelling it could lose a message already taken off the inlet."""
        got: list[Any] = []
        while len(got) < count:
            left = None if deadline is None else deadline - time.time()
            if (stopping is not None and stopping.is_set()) or (left is not None and left <= 0):
                return None
            if self.next_msg is None:
                self.next_msg = asyncio.ensure_future(self.inbox.recv())
            stop = asyncio.ensure_future(stopping.wait()) if stopping is not None else None
            try:
                await asyncio.wait({self.next_msg, *([stop] if stop else [])}, timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if stop is not None:
                    stop.cancel()
            if not self.next_msg.done():
                continue  # stopped or out of time: checked at the top
            msg, self.next_msg = self.next_msg.result(), None
            if msg is None:  # the end of the stream
                return None
            if keep(msg):
                got.append(msg)
        return got

    async def drain_sources(self, sources: Any, count: int) -> None:
        """Drain the ``count`` sources at once; name those that do not answer in time."""
        calls = {f"gen{r}": asyncio.ensure_future(sources.slice(gpus=r).drain.call_one())
                 for r in range(count)}
        t0 = time.monotonic()
        done, late = await asyncio.wait(calls.values(), timeout=self.finish_timeout_s)
        for task in late:
            await cancel_task(task, quiet=True)
        if late:
            names = ", ".join(name for name, task in calls.items() if task in late)
            raise RingError(
                f"{self.name}: {names} did not finish draining within "
                f"{time.monotonic() - t0:.1f} s ({self.timeout_field}={self.finish_timeout_s:g}):"
                " a source that does not answer drain died or is stuck, and the ring cannot end "
                "without its end of stream")
        for task in done:
            task.result()  # a drain that failed: its error, as it is

    async def recv_within(self, waiting: str, pending: Awaitable[Any] | None = None) -> Any:
        """The next message (or ``pending``'s) within ``finish_timeout_s``, else a RingError."""
        t0 = time.monotonic()
        try:
            return await asyncio.wait_for(
                pending if pending is not None else self.inbox.recv(), self.finish_timeout_s)
        except TimeoutError:
            raise RingError(
                f"{self.name}: nothing from {self.sender} for {time.monotonic() - t0:.1f} s "
                f"({self.timeout_field}={self.finish_timeout_s:g}) while waiting for {waiting}: "
                f"{self.sender} died or never sent the end of the stream (None)") from None

    async def discard_queued(self) -> int:
        """After the sources were drained: read up to the ``None`` (first the receive
        :meth:`collect` left pending, if any) and count what was left."""
        left, pending, self.next_msg = 0, self.next_msg, None
        while await self.recv_within(f"the end of the stream ({left} discarded)",
                                     pending) is not None:
            left, pending = left + 1, None  # produced but never trained on: running ahead
        return left

    async def __cleanup__(self, exc: Any) -> None:
        await super().__cleanup__(exc)
        await cancel_task(self.next_msg, quiet=True)


class Relay(Sink):
    """A middle stage: ``inlet → process(msg) → out``, one ``None`` on once all ``upstream`` ended."""

    upstream = 1
    label = "work"

    @endpoint
    async def start(self, out: Any) -> None:
        self.launch(self._relay(out))

    async def _relay(self, out: Any) -> None:
        ended = 0
        while ended < self.upstream:
            # once one sender has ended the others are being drained: a silent one is stuck
            msg = await (self.recv_within(f"{self.upstream - ended} more end(s) of stream "
                                          f"({ended} of {self.upstream} senders ended)")
                         if ended else self.inbox.recv())
            if msg is None:
                ended += 1
                continue
            start = time.time()
            out.send(await self.process(msg))
            self.busy.add(self.label, start)
        out.send(None)
        self.busy.flush()
        self.report("exited", actor=self.name)

    async def process(self, msg: Any) -> Any:
        raise NotImplementedError


@dataclass
class Ring:
    """A started ring's four actor meshes (:meth:`Controller.start_ring`)."""

    trainer: Any
    scorer: Any
    reference: Any
    generators: Any


class Controller:
    """Spawns, wires, watches and stops a ring's stages, on ``"asyncio"`` or ``"monarch"``."""

    def __init__(self, backend_name: str = "asyncio", recorder: MetricsRecorder | None = None,
                 *, stop_timeout_s: float = 15.0) -> None:
        self.backend, self.api = backend_name, backend(backend_name)
        self.rec = recorder if recorder is not None else MetricsRecorder(None)
        self.stop_timeout_s = stop_timeout_s
        self.offset = self.rec.now() - time.time()  # actors stamp wall clock; rows use rec time
        self.metrics, self.inbox = self.api.Channel.open()
        self._meshes: list[Any] = []
        self._procs: list[Any] = []

    def procs(self, n: int = 1, *, here: bool = False) -> Any:
        """A proc mesh of ``n`` processes (labelled ``gpus``), or this process (``here``)."""
        if here:
            return self.api.this_proc()
        procs = self.api.this_host().spawn_procs(per_host={"gpus": n})
        self._procs.append(procs)
        return procs

    def spawn(self, procs: Any, name: str, cls: type, *args: Any) -> Any:
        mesh = procs.spawn(name, class_for(cls, self.api), *args)
        self._meshes.append(mesh)
        return mesh

    async def start_ring(self, stages: Mapping[str, type], args: tuple | Mapping[str, tuple],
                         *, generators: int, procs: Mapping[str, Any] | None = None,
                         admit: Admit | None = None) -> Ring:
        """Spawn a ring's four ``stages`` (role → actor class; roles as :class:`Ring`'s fields)
        and :meth:`wire` them. Each is built with ``args`` (or its role's, from a mapping), then
        the generators with the scorer's inlet, then ``metrics``, then the trainer with
        ``admit`` (None: :func:`grpo_nb.ring_core.admit`). ``procs``: role → proc mesh; by
        default ``generators`` processes for the generators, this process for the others."""
        procs, made = dict(procs or {}), {}
        for role in ("trainer", "scorer", "reference", "generators"):  # the trainer loads first
            where = procs.get(role) or (self.procs(generators) if role == "generators"
                                        else self.procs(here=True))
            built = [*(args[role] if isinstance(args, Mapping) else args)]
            if role == "generators":
                built.append(await made["scorer"].inlet.call_one())
            built.append(self.metrics)
            made[role] = self.spawn(where, role, stages[role], *built,
                                    *((admit,) if role == "trainer" else ()))
        ring = Ring(**made)
        await self.wire(ring.generators, ring.scorer, ring.reference, ring.trainer)
        return ring

    async def wire(self, generators: Any, scorer: Any, reference: Any, trainer: Any) -> None:
        """Start the stages back to front: every stage's output exists before anything flows in."""
        await trainer.start.call_one(generators)
        await reference.start.call_one(await trainer.inlet.call_one())
        await scorer.start.call_one(await reference.inlet.call_one())
        await generators.start.call()

    async def relay(self, until: Collection[str], *,
                    on_event: Callable[[Event], None] | None = None,
                    watchers: Sequence[Awaitable[Any]] = (),
                    explain: Callable[[Event], Awaitable[BaseException]] | None = None,
                    ) -> dict[str, dict[str, Any]]:
        """Record events until every actor in ``until`` exited (their exit data returned); a watcher
        that raises or an actor's error (through ``explain(event)``, if given) ends it."""
        waiting, exited = set(until), {}
        tasks = {asyncio.ensure_future(w) for w in watchers}
        recv: asyncio.Future | None = None
        try:
            while waiting:
                if recv is None:
                    recv = asyncio.ensure_future(self.inbox.recv())
                done, _ = await asyncio.wait({recv, *tasks}, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {recv}:
                    tasks.discard(task)
                    task.result()  # a watcher's exception ends the run
                if recv not in done:
                    continue
                event, recv = recv.result(), None
                if event.kind == "exited":
                    waiting.discard(event.data["actor"])
                    exited[event.data["actor"]] = event.data
                elif event.kind == "error":
                    if explain is not None:
                        raise await explain(event)
                    raise RingError(f"ring actor {event.data['actor']} failed: "
                                    f"{event.data['error']}\n{event.data['traceback']}")
                elif event.kind == "busy":
                    for actor, label, start, end in event.data:
                        self.rec.log("busy", t=end + self.offset, actor=actor, label=label,
                                     start=start + self.offset, end=end + self.offset)
                else:
                    self.rec.log(event.kind, **event.data)
                if on_event is not None:
                    on_event(event)
        finally:
            for task in [*tasks, recv]:
                await cancel_task(task, quiet=True)
        return exited

    async def stop(self) -> None:
        """Stop every actor mesh, then every proc mesh; one that hangs or fails stops no other."""
        for mesh in [*reversed(self._meshes), *self._procs]:
            try:
                await asyncio.wait_for(asyncio.ensure_future(mesh.stop()), self.stop_timeout_s)
            except Exception as err:  # TimeoutError too
                print(f"warning: stopping {mesh!r} failed: {err!r}", file=sys.stderr)
        self._meshes, self._procs = [], []

    async def __aenter__(self) -> Controller:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
