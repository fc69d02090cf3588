"""Channels and ports: one-way, ordered, fire-and-forget pipes between actors.

::

    port, receiver = Channel.open()
    port.send(x)          ──► [ copy of x ] [ ... ] ──► await receiver.recv()  (in order)
    port.exception(err)   ──► [ err ]               ──► recv() raises err

The ``Port`` is an *address*: it can be handed to any number of actors (as a constructor or
endpoint argument) and they all write into the same receiver. The receiver stays with the
actor that opened the channel. ``Channel.open(once=True)`` gives a port that may be used once
(a reply slot).
"""

from __future__ import annotations

import asyncio
from typing import Any, Generic, TypeVar

from grpo_nb.actors._core import Future, Handle, on_monarch, transfer

R = TypeVar("R")


class _Raise:
    """Queue item that makes ``recv`` raise instead of returning."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class PortReceiver(Generic[R]):
    """The receiving end of a channel: ``await receiver.recv()`` yields messages in order."""

    def __init__(self) -> None:
        # An unbounded queue: like Monarch, sending never blocks, so a fast producer and a
        # slow consumer show up as queue depth (a metric the toy ring records), not as stalls.
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    async def _recv(self) -> R:
        item = await self._queue.get()
        if isinstance(item, _Raise):
            raise item.error
        return item

    def recv(self) -> Future[R]:
        """A future of the next message (raises if the sender called ``Port.exception``)."""
        return Future(self._recv)

    def qsize(self) -> int:
        """Messages waiting. (grpo_nb only: torchmonarch's receiver does not expose this.)"""
        return self._queue.qsize()

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)


class Port(Handle, Generic[R]):
    """The sending end of a channel. ``send`` copies the value and returns at once."""

    def __init__(self, receiver: PortReceiver[R], once: bool = False) -> None:
        self._receiver = receiver
        self._once = once
        self._used = False

    def _claim(self) -> None:
        if self._once:
            if self._used:
                raise ValueError("this port was opened with once=True and has already been used")
            self._used = True

    def send(self, obj: R) -> None:
        """Deliver a copy of ``obj`` to the receiver, after everything sent on it before."""
        copy = transfer(obj)
        self._claim()
        self._receiver._put(copy)

    def exception(self, error: BaseException) -> None:
        """Make the receiver's next ``recv()`` raise ``error`` (after earlier messages)."""
        self._claim()
        self._receiver._put(_Raise(transfer(error)))

    def __repr__(self) -> str:
        return f"Port(once={self._once}, waiting={self._receiver.qsize()})"


class Channel(Generic[R]):
    """Factory for a ``(Port, PortReceiver)`` pair."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        if on_monarch.get():  # inside an actor running on Monarch: a Monarch channel
            import monarch.actor

            return monarch.actor.Channel.open(once)
        receiver: PortReceiver[R] = PortReceiver()
        return Port(receiver, once=once), receiver
