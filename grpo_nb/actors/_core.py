"""The runtime's messages: copying, errors, value meshes, futures, channels. Whatever crosses a
port or an endpoint is copied (as between Monarch's processes), so shared state cannot leak.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import math
import pickle
import sys
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping
from traceback import TracebackException
from typing import Any, Generic, TypeVar

try:  # Monarch pickles with cloudpickle (classes defined in a cell travel by value)
    from cloudpickle import CloudPickler
except ImportError:  # pragma: no cover - cloudpickle comes with torchmonarch
    CloudPickler = None

R = TypeVar("R")

_IMMUTABLE = (int, float, bool, str, bytes, type(None))


class Handle:
    """Marker base class of addresses (ports, meshes, endpoints): they travel as themselves."""


def _copy_tensor(obj: Any) -> Any:
    """A CPU tensor's own copy, without serialising it (the receiver gets its own memory)."""
    torch = sys.modules.get("torch")
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != "cpu":
        return None
    data = obj.detach().clone().requires_grad_(obj.is_leaf and obj.requires_grad)
    return torch.nn.Parameter(data, data.requires_grad) if type(obj) is torch.nn.Parameter else data


# The C pickler first (fast); cloudpickle when something must travel by value (a class or
# lambda defined in a notebook cell), as Monarch would ship it.
_PICKLERS = [p for p in (pickle.Pickler, CloudPickler) if p is not None]


def transfer(obj: Any) -> Any:
    """The copy of ``obj`` that a receiving actor would see (a pickle round trip); what
    cannot cross a process boundary (a lock, a generator, ...) raises here, at the sender."""
    if isinstance(obj, (_IMMUTABLE, Handle)):
        return obj
    handles: list[Any] = []

    def out_of_band(item: Any) -> int | None:  # handles as they are, CPU tensors copied
        kept = item if isinstance(item, Handle) else _copy_tensor(item)
        if kept is None:
            return None
        handles.append(kept)
        return len(handles) - 1

    for i, pickler_class in enumerate(_PICKLERS, 1):
        handles.clear()
        buf = io.BytesIO()
        pickler = pickler_class(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = out_of_band
        try:
            pickler.dump(obj)
            break
        except (pickle.PicklingError, AttributeError, TypeError):
            if i == len(_PICKLERS):
                raise
    buf.seek(0)
    unpickler = pickle.Unpickler(buf)
    unpickler.persistent_load = handles.__getitem__
    return unpickler.load()


class ActorError(Exception):
    """An exception raised inside an actor, as the caller sees it: ``exception`` is the
    original; ``str()`` includes the traceback of where the remote call failed."""

    def __init__(self, exception: BaseException, message: str = "A remote actor call has failed.",
                 formatted: str | None = None) -> None:
        super().__init__(message)
        self.exception, self.message = exception, message
        self.exception_formatted = formatted or "".join(
            TracebackException.from_exception(exception).format()).replace(
            "Traceback (most recent call last):",
            "Traceback of where the remote call failed (most recent call last):")

    def __str__(self) -> str:
        return f"{self.message}\n {self.exception_formatted}"

    def __reduce__(self) -> tuple[Any, ...]:
        # The traceback does not pickle: its text travels with the exception.
        return (ActorError, (self.exception, self.message, self.exception_formatted))


class Point(dict[str, int]):
    """A coordinate in a mesh, e.g. ``{"gpus": 2}``; ``.rank`` is its flat index."""

    def __init__(self, rank: int, extent: Mapping[str, int]) -> None:
        sizes = list(extent.values())
        super().__init__({k: rank // math.prod(sizes[i + 1:]) % n
                          for i, (k, n) in enumerate(extent.items())})
        self.rank, self.extent = rank, dict(extent)


class ValueMesh(Generic[R]):
    """The results of ``endpoint.call()``: one value per actor, addressed by :class:`Point`."""

    def __init__(self, values: list[R], extent: Mapping[str, int]) -> None:
        self._values = list(values)
        self.extent = dict(extent)

    def values(self) -> list[R]:
        return list(self._values)

    def items(self) -> Iterator[tuple[Point, R]]:
        for rank, value in enumerate(self._values):
            yield Point(rank, self.extent), value

    def item(self, **coords: int) -> R:
        """The value at ``coords`` (none needed on a one-actor mesh)."""
        found = [v for point, v in self.items() if all(point[k] == c for k, c in coords.items())]
        if len(found) != 1:
            raise ValueError(f"item({coords}) matches {len(found)} of {len(self)} values")
        return found[0]

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ValueMesh({self.extent}): {self._values!r}"


_private_loop: asyncio.AbstractEventLoop | None = None


def home_loop() -> asyncio.AbstractEventLoop:
    """The running loop, or (from synchronous code) a private loop that ``Future.get`` drives."""
    global _private_loop
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        if _private_loop is None or _private_loop.is_closed():
            _private_loop = asyncio.new_event_loop()
        return _private_loop


class Future(Generic[R]):
    """A result to ``await`` in async code, or ``.get()`` in sync code. The message is sent
    already: not awaiting a Future ignores the answer, it does not cancel the work."""

    def __init__(self, make: Callable[[], Awaitable[R]]) -> None:
        self._make = make
        self._task: asyncio.Future[R] | None = None

    def _ensure(self) -> asyncio.Future[R]:
        if self._task is None:
            self._task = asyncio.ensure_future(self._make(), loop=home_loop())
        return self._task

    def __await__(self) -> Generator[Any, None, R]:
        return self._ensure().__await__()

    def get(self, timeout: float | None = None) -> R:
        loop = home_loop()
        if loop.is_running():
            raise RuntimeError("Future.get() inside a running event loop would block it: use `await`")
        return loop.run_until_complete(asyncio.wait_for(self._ensure(), timeout))


# Set (by grpo_nb.actors._monarch, which imports monarch.actor) while an actor class runs on
# Monarch: the runtime functions its code calls (Channel.open, current_rank, send) use Monarch's.
on_monarch: contextvars.ContextVar[bool] = contextvars.ContextVar("grpo_nb_on_monarch", default=False)
current_point: contextvars.ContextVar[Point | None] = contextvars.ContextVar("grpo_nb_actor_point", default=None)


def current_rank() -> Point:
    """The position of the actor handling the current message within its mesh."""
    if on_monarch.get():
        return sys.modules["monarch.actor"].current_rank()
    point = current_point.get()
    if point is None:
        raise RuntimeError("current_rank() is only defined inside an actor endpoint")
    return point


class PortReceiver(Generic[R]):
    """The receiving end of a channel: ``await receiver.recv()`` yields messages in order."""

    def __init__(self) -> None:
        # Unbounded, like Monarch's: sending never blocks, so a slow consumer shows up as
        # queue depth (a metric the toy ring records), not as a stalled producer.
        self._queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

    async def _recv(self) -> R:
        ok, item = await self._queue.get()
        if not ok:
            raise item
        return item

    def recv(self) -> Future[R]:
        """A future of the next message (raises if the sender called ``Port.exception``)."""
        return Future(self._recv)

    def qsize(self) -> int:
        """Messages waiting (grpo_nb only: torchmonarch's receiver does not expose it)."""
        return self._queue.qsize()


class Port(Handle, Generic[R]):
    """The sending end of a channel. ``send`` copies the value and returns at once."""

    def __init__(self, receiver: PortReceiver[R], once: bool = False) -> None:
        self._receiver, self._once, self._used = receiver, once, False

    def _put(self, ok: bool, item: Any) -> None:
        if self._once and self._used:
            raise ValueError("this port was opened with once=True and has already been used")
        self._used = True
        self._receiver._queue.put_nowait((ok, item))

    def send(self, obj: R) -> None:
        """Deliver a copy of ``obj`` to the receiver, after everything sent on it before."""
        self._put(True, transfer(obj))

    def exception(self, error: BaseException) -> None:
        """Make the receiver's next ``recv()`` raise ``error`` (after earlier messages)."""
        self._put(False, transfer(error))


class Channel(Generic[R]):
    """``Channel.open()``: a ``Port`` (an address that any number of actors may write to) and
    the ``PortReceiver`` that stays with the opener; ``once=True``: a port for one reply."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        if on_monarch.get():  # inside an actor running on Monarch: a Monarch channel
            return sys.modules["monarch.actor"].Channel.open(once)
        receiver: PortReceiver[R] = PortReceiver()
        return Port(receiver, once=once), receiver
