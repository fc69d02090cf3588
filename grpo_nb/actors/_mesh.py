"""Actors, endpoints and meshes on one asyncio loop, with torchmonarch's rules: one message at a
time (``@concurrent_endpoint`` opts out), endpoints all async or all sync, arguments copied, errors
raised to the caller as :class:`ActorError` (or logged, for fire-and-forget messages)."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from grpo_nb.actors._core import (
    ActorError,
    Future,
    Handle,
    Point,
    Port,
    PortReceiver,
    ValueMesh,
    current_point,
    home_loop,
    transfer,
)

log = logging.getLogger("grpo_nb.actors")
_MESH_ATTRS = frozenset({"stop", "slice", "size", "extent", "initialized", "flatten", "split", "rename"})


class endpoint:
    """``@endpoint``: marks an actor method as callable through meshes, one message at a time."""

    concurrent = False

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.is_async = inspect.iscoroutinefunction(fn)
        if self.concurrent and not self.is_async:
            raise TypeError(f"@concurrent_endpoint needs an async def, got {fn.__qualname__}")
        self.fn = fn
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        # Inside the actor, ``self.method(...)`` is a plain method call (no message).
        return self if obj is None else self.fn.__get__(obj, owner)


class concurrent_endpoint(endpoint):
    """Like :class:`endpoint`, but each message runs as its own task, so the actor can take
    the next message while this one awaits. It must be ``async def``."""

    concurrent = True


class Actor:
    """Base class of actors. Define endpoints with ``@endpoint``; optionally
    ``async def __cleanup__(self, exc)`` to release what the actor owns when it stops."""


def _endpoints_of(cls: type) -> dict[str, endpoint]:
    return {name: value for klass in reversed(cls.__mro__) for name, value in vars(klass).items()
            if isinstance(value, endpoint)}


def _check_actor_class(cls: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"{cls!r} is not a subclass of grpo_nb.actors.Actor")
    eps = _endpoints_of(cls)
    if clash := sorted(set(eps) & _MESH_ATTRS):
        raise ValueError(f"{cls.__name__}: endpoint names {clash} shadow ActorMesh attributes")
    kinds = {ep.is_async for ep in eps.values()}
    if len(kinds) > 1:
        sync = sorted(n for n, ep in eps.items() if not ep.is_async)
        raise ValueError(f"{cls.__name__} mixes async and sync endpoints (sync: {sync})")
    cleanup = getattr(cls, "__cleanup__", None)
    if cleanup is not None and kinds == {True} and not inspect.iscoroutinefunction(cleanup):
        raise ValueError(f"{cls.__name__} has async endpoints but a synchronous __cleanup__")


@dataclass
class _Message:
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    port: Port[Any] | None  # where the result or error goes; None: errors are reported


class _Cell:
    """One actor: its instance, its mailbox and the task that drains it."""

    def __init__(self, cls: type, name: str, point: Point, args: tuple, kwargs: dict) -> None:
        self.cls, self.name, self.point = cls, name, point
        self.endpoints = _endpoints_of(cls)
        self.mailbox: asyncio.Queue[_Message] = asyncio.Queue()
        self.side_tasks: set[asyncio.Task[Any]] = set()
        self.stopped = False
        self.instance: Any = None
        self.init_error: BaseException | None = None
        # The actor's tasks run in this context (those it starts copy it): current_rank() is point.
        self.context = contextvars.copy_context()
        self.context.run(current_point.set, point)
        self.task = home_loop().create_task(self._main(args, kwargs), name=f"actor:{name}[{point.rank}]",
                                            context=self.context)

    async def _main(self, args: tuple, kwargs: dict) -> None:
        try:
            self.instance = self.cls(*args, **kwargs)
        except Exception as err:  # reported on every call, like a failed remote spawn
            self.init_error = err
        while True:
            msg = await self.mailbox.get()
            if self.init_error is not None:
                self._deliver(msg, None, ActorError(self.init_error, f"{self.name}.__init__ failed."))
            elif self.endpoints[msg.method].concurrent:
                task = asyncio.create_task(self._handle(msg))
                self.side_tasks.add(task)
                task.add_done_callback(self.side_tasks.discard)
            else:
                await self._handle(msg)

    async def _handle(self, msg: _Message) -> None:
        try:
            out = getattr(self.instance, msg.method)(*msg.args, **msg.kwargs)
            if inspect.isawaitable(out):
                out = await out
        except asyncio.CancelledError:
            self._deliver(msg, None, ActorError(asyncio.CancelledError(), f"{self.name}.{msg.method} was cancelled (actor stopped)."))
            raise
        except Exception as err:
            self._deliver(msg, None, ActorError(err, f"Actor call {self.name}.{msg.method} failed."))
        else:
            self._deliver(msg, out, None)

    def _deliver(self, msg: _Message, value: Any, error: ActorError | None) -> None:
        if msg.port is None:
            if error is not None and not isinstance(error.exception, asyncio.CancelledError):
                log.error("unhandled error in fire-and-forget %s.%s\n%s", self.name, msg.method, error)
            return
        try:
            if error is None:
                msg.port.send(value)
                return
            msg.port.exception(error)
        except Exception as err:  # a result or an error that cannot be pickled
            what = "result" if error is None else f"error ({error})"
            msg.port.exception(ActorError(err, f"{self.name}.{msg.method}: its {what} cannot be sent"))

    def post(self, msg: _Message) -> None:
        if self.stopped:
            self._deliver(msg, None, ActorError(RuntimeError(f"actor {self.name} is stopped")))
        else:
            self.mailbox.put_nowait(msg)

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        running = [self.task, *self.side_tasks]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        # The message that was running has already answered "cancelled" from _handle.
        while not self.mailbox.empty():
            msg = self.mailbox.get_nowait()
            self._deliver(msg, None, ActorError(RuntimeError(f"actor {self.name} stopped before handling {msg.method}")))
        if getattr(self.instance, "__cleanup__", None) is not None:  # its errors are reported
            cleanup = self._handle(_Message("__cleanup__", (None,), {}, None))
            await asyncio.create_task(cleanup, context=self.context)


def _stop_now(cells: list[_Cell]) -> Future[None]:
    """Stop ``cells``: stopping starts now, whether the future is awaited or not."""

    async def stop_all() -> None:
        await asyncio.gather(*(c.stop() for c in cells))

    fut: Future[None] = Future(stop_all)
    fut._ensure()
    return fut


class MeshEndpoint(Handle):
    """``mesh.method``: the ways to send one endpoint's message to the actors of a mesh."""

    def __init__(self, mesh: ActorMesh, name: str) -> None:
        self._mesh, self._name = mesh, name

    def _post(self, cells: list[_Cell], args: tuple, kwargs: dict, port: Port | None = None) -> None:
        for cell in cells:  # each receiver gets its own copy, as each process would unpickle its own
            cell.post(_Message(self._name, transfer(args), transfer(kwargs), port))

    def _ask(self, cell: _Cell, args: tuple, kwargs: dict) -> Future[Any]:
        receiver: PortReceiver[Any] = PortReceiver()
        self._post([cell], args, kwargs, Port(receiver, once=True))
        return receiver.recv()

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[Any]]:
        """Send to every actor; the future holds one value per actor."""
        answers = [self._ask(cell, args, kwargs) for cell in self._mesh._cells]

        async def gather() -> ValueMesh[Any]:
            return ValueMesh(list(await asyncio.gather(*answers)), self._mesh.extent)

        return Future(gather)

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Send to the mesh's only actor (an error on a mesh of several)."""
        if len(self._mesh._cells) != 1:
            raise ValueError(f"call_one requires exactly 1 actor, but mesh has {len(self._mesh._cells)}")
        return self._ask(self._mesh._cells[0], args, kwargs)

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Send to one actor picked at random (load balancing); the future holds its value."""
        return self._ask(random.choice(self._mesh._cells), args, kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every actor and do not wait; failures are logged, not returned."""
        self._post(self._mesh._cells, args, kwargs)


def send(endpoint: MeshEndpoint, args: tuple, kwargs: dict, port: Port | None = None,
         selection: Literal["all", "choose"] = "all") -> None:
    """Fire-and-forget to every actor (``"all"``) or one at random (``"choose"``); with ``port``,
    each result (or error) is sent there. A Monarch endpoint goes to Monarch's send."""
    if not isinstance(endpoint, MeshEndpoint):
        import monarch.actor

        monarch.actor.send(endpoint, tuple(args), dict(kwargs), port=port, selection=selection)
        return
    if selection not in ("all", "choose"):
        raise ValueError(f"selection must be 'all' or 'choose', got {selection!r}")
    cells = endpoint._mesh._cells
    endpoint._post(cells if selection == "all" else [random.choice(cells)], tuple(args),
                   dict(kwargs), port)


class ActorMesh(Handle):
    """A group of actors of one class, one per process of a :class:`ProcMesh`."""

    def __init__(self, name: str, cls: type, cells: list[_Cell], extent: Mapping[str, int]) -> None:
        self._name, self._class, self._cells, self.extent = name, cls, cells, dict(extent)
        self._endpoint_names = set(_endpoints_of(cls))

    def __getattr__(self, name: str) -> MeshEndpoint:
        if name.startswith("_") or name not in self._endpoint_names:
            raise AttributeError(f"{self._class.__name__} has no endpoint {name!r}")
        return MeshEndpoint(self, name)

    def slice(self, **coords: int) -> ActorMesh:
        """The sub-mesh at the given coordinates, e.g. ``mesh.slice(gpus=0)`` (one actor)."""
        if unknown := set(coords) - set(self.extent):
            raise ValueError(f"unknown mesh dimensions {sorted(unknown)}; mesh has {list(self.extent)}")
        cells = [c for c in self._cells if all(c.point[k] == v for k, v in coords.items())]
        extent = {k: n for k, n in self.extent.items() if k not in coords}
        return ActorMesh(self._name, self._class, cells, extent)

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Stop every actor: cancel its running message, fail queued ones, run ``__cleanup__``."""
        return _stop_now(list(self._cells))

    def __repr__(self) -> str:
        return f"ActorMesh({self._name!r}, {self._class.__name__}, {self.extent})"


class ProcMesh(Handle):
    """Stands for a group of processes. Here they are labels: every actor lives on one loop."""

    def __init__(self, extent: Mapping[str, int]) -> None:
        self.extent = dict(extent)
        self._cells: list[_Cell] = []  # of every mesh spawned here

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """One ``cls`` actor per process; each constructor gets its own copy of the arguments."""
        _check_actor_class(cls)
        cells = [_Cell(cls, name, Point(rank, self.extent), transfer(args), transfer(kwargs))
                 for rank in range(math.prod(self.extent.values()))]
        self._cells += cells
        return ActorMesh(name, cls, cells, self.extent)

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        return _stop_now(list(self._cells))


class HostMesh:
    """This machine. ``spawn_procs(per_host={"gpus": 4})``: the label is only a name on CPU."""

    def spawn_procs(self, per_host: Mapping[str, int] | None = None, name: str = "procs") -> ProcMesh:
        extent = dict(per_host or {"procs": 1})
        if any(int(n) < 1 for n in extent.values()):
            raise ValueError(f"per_host sizes must be >= 1, got {extent}")
        return ProcMesh(extent)


def this_host() -> HostMesh:
    return HostMesh()


def this_proc() -> ProcMesh:
    """A one-process mesh standing for the caller's own process."""
    return ProcMesh({})
