"""The small pieces every part of the runtime shares: futures, errors, value meshes, copying.

Nothing here knows about actors yet; :mod:`grpo_nb.actors._mesh` and
:mod:`grpo_nb.actors._ports` build on it::

    call()/recv() ──► Future ──await──► value      (or ActorError with the remote traceback)
    send(x)       ──► transfer(x) ──► a private copy for the receiver (pickled, like Monarch)

Why copy? Real actors live in separate processes and share no memory: whatever crosses a
port or an endpoint is pickled on one side and unpickled on the other. An in-process runtime
that passed references would let a learner's code mutate another actor's state and work here
but break on torchmonarch. So every message is pickled and unpickled, exactly once.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import pickle
import sys
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping
from traceback import TracebackException
from typing import Any, Generic, TypeVar

try:  # Monarch pickles with cloudpickle (classes defined in a cell travel by value)
    from cloudpickle import CloudPickler as _CloudPickler
except ImportError:  # pragma: no cover - cloudpickle comes with torchmonarch
    _CloudPickler = None

R = TypeVar("R")

_IMMUTABLE = (int, float, bool, str, bytes, type(None))


class Handle:
    """Marker base class: objects that are *addresses* (ports, meshes, endpoints).

    Pickling a handle keeps the very same object — an address names a mailbox, it does not
    own data — which is what Monarch's port re-binding amounts to inside one process.
    """


class _HandleMixin:
    _handles: list[Any]

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, Handle):
            self._handles.append(obj)
            return len(self._handles) - 1
        copied = _copy_tensor(obj)
        if copied is not None:
            self._handles.append(copied)
            return len(self._handles) - 1
        return None


class _FastPickler(_HandleMixin, pickle.Pickler):
    def __init__(self, file: io.BytesIO, handles: list[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._handles = handles


if _CloudPickler is not None:

    class _ByValuePickler(_HandleMixin, _CloudPickler):  # type: ignore[misc, valid-type]
        def __init__(self, file: io.BytesIO, handles: list[Any]) -> None:
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self._handles = handles

    _PICKLERS: tuple[type, ...] = (_FastPickler, _ByValuePickler)
else:  # pragma: no cover
    _PICKLERS = (_FastPickler,)


def _copy_tensor(obj: Any) -> Any:
    """A CPU tensor's copy without serialising it (pickling a tensor costs ~1 ms: torch.save).

    The receiver still gets its own memory, which is all that copying is for here. (Views
    of one storage inside a message become independent tensors: unlike pickle, aliasing is
    not preserved.)
    """
    torch = sys.modules.get("torch")
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != "cpu":
        return None
    data = obj.detach().clone()
    if type(obj) is torch.nn.Parameter:
        return torch.nn.Parameter(data, requires_grad=obj.requires_grad)
    return data.requires_grad_(obj.requires_grad) if obj.is_leaf else data


class _HandleUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, handles: list[Any]) -> None:
        super().__init__(file)
        self._handles = handles

    def persistent_load(self, pid: Any) -> Handle:
        return self._handles[pid]


def transfer(obj: Any) -> Any:
    """Return the copy of ``obj`` that a receiving actor would see (pickle round trip).

    Raises the pickling error at the *sender*, as Monarch does, for things that cannot cross
    a process boundary (open files, locks, generators, asyncio objects, ...).
    """
    if isinstance(obj, (_IMMUTABLE, Handle)):
        return obj
    # The C pickler first (fast); cloudpickle when something must travel by value (a class or
    # lambda defined in a notebook cell), as Monarch would ship it.
    for i, pickler in enumerate(_PICKLERS):
        handles: list[Any] = []
        buf = io.BytesIO()
        try:
            pickler(buf, handles).dump(obj)
        except (pickle.PicklingError, AttributeError, TypeError):
            if i == len(_PICKLERS) - 1:
                raise
            continue
        buf.seek(0)
        return _HandleUnpickler(buf, handles).load()
    raise AssertionError("unreachable")


class ActorError(Exception):
    """An exception raised inside an actor, as the caller sees it.

    ``exception`` is the original exception; ``str()`` includes the traceback *of the place
    where the remote call failed* (the caller's own traceback says nothing useful about it).
    """

    def __init__(self, exception: BaseException, message: str = "A remote actor call has failed.") -> None:
        super().__init__(message)
        self.exception = exception
        lines = TracebackException.from_exception(exception).format()
        self.exception_formatted = "".join(lines).replace(
            "Traceback (most recent call last):",
            "Traceback of where the remote call failed (most recent call last):",
        )
        self.message = message

    def __str__(self) -> str:
        return f"{self.message}\n {self.exception_formatted}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ActorError, (self.exception, self.message))


class Point(Mapping[str, int]):
    """A coordinate in a mesh, e.g. ``{"gpus": 2}``; ``.rank`` is its flat index."""

    def __init__(self, rank: int, extent: Mapping[str, int]) -> None:
        self.rank = rank
        self.extent = dict(extent)
        coords: dict[str, int] = {}
        rest = rank
        for label in reversed(list(self.extent)):
            coords[label] = rest % self.extent[label]
            rest //= self.extent[label]
        self._coords = {k: coords[k] for k in self.extent}

    def __getitem__(self, key: str) -> int:
        return self._coords[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __repr__(self) -> str:
        return f"Point({self._coords}, rank={self.rank})"


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
        """The single value (no arguments on a one-actor mesh), or the one at ``coords``."""
        if not coords:
            if len(self._values) != 1:
                raise ValueError(f"item() needs coordinates on a mesh of {len(self._values)} values")
            return self._values[0]
        for point, value in self.items():
            if all(point[k] == v for k, v in coords.items()):
                return value
        raise KeyError(coords)

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[tuple[Point, R]]:
        return self.items()

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
    """A result that is awaited (``await fut``) in async code, or ``fut.get()`` in sync code.

    The message has already been sent when a Future exists: not awaiting it does not cancel
    the work, it only ignores the answer.
    """

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
        """Block until the value is there. Only from synchronous code (no running loop)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("Future.get() inside a running event loop would block it: use `await`")
        loop = home_loop()
        return loop.run_until_complete(asyncio.wait_for(self._ensure(), timeout))


# Set while a module-level actor class runs as a Monarch actor (grpo_nb.actors._monarch), so
# the runtime functions its code calls (Channel.open, current_rank, send) use Monarch's.
on_monarch: contextvars.ContextVar[bool] = contextvars.ContextVar("grpo_nb_on_monarch",
                                                                  default=False)

_current_point: contextvars.ContextVar[Point | None] = contextvars.ContextVar(
    "grpo_nb_actor_point", default=None
)


def current_rank() -> Point:
    """The position of the actor handling the current message within its mesh."""
    if on_monarch.get():
        import monarch.actor

        return monarch.actor.current_rank()
    point = _current_point.get()
    if point is None:
        raise RuntimeError("current_rank() is only defined inside an actor endpoint")
    return point
