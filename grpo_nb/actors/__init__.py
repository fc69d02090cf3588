"""An actor runtime in plain asyncio with torchmonarch's surface.

Code written against this module runs on real Monarch processes by changing one import line::

    from grpo_nb.actors import Actor, Channel, endpoint, send, this_host   # one process, asyncio
    from monarch.actor import Actor, Channel, endpoint, send, this_host    # real processes

or, without editing code: write the actor classes once, at module level, against this module,
and spawn them on either runtime's proc meshes with ``procs.spawn(name, class_for(Cls, api))``
where ``api = backend("asyncio" | "monarch")`` (see :mod:`._monarch` for how).

Data flow of a typical ring::

    controller ──spawn──► actors ──Port.send──► next actor's PortReceiver ──► ... ──► controller
         ▲                  ▲                                                   │
         └──── Future ◄─────┴──────── endpoint.call() / send(..., "choose") ◄───┘

Modules: :mod:`._core` (futures, errors, copying), :mod:`._ports` (channels), :mod:`._monarch`
(the same classes on Monarch),
:mod:`._mesh` (actors, endpoints, meshes, ``send``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from grpo_nb.actors._core import ActorError, Future, Point, ValueMesh, current_rank, transfer
from grpo_nb.actors._mesh import (
    Actor,
    ActorMesh,
    HostMesh,
    MeshEndpoint,
    ProcMesh,
    concurrent_endpoint,
    endpoint,
    send,
    this_host,
    this_proc,
    unhandled_errors,
)
from grpo_nb.actors._ports import Channel, Port, PortReceiver

__all__ = [
    "Actor",
    "ActorError",
    "ActorMesh",
    "Channel",
    "Future",
    "HostMesh",
    "MeshEndpoint",
    "Point",
    "Port",
    "PortReceiver",
    "ProcMesh",
    "ValueMesh",
    "backend",
    "class_for",
    "concurrent_endpoint",
    "current_rank",
    "endpoint",
    "monarch_available",
    "send",
    "this_host",
    "this_proc",
    "transfer",
    "unhandled_errors",
]

BACKENDS = ("asyncio", "monarch")
MONARCH_MISSING = (
    "torchmonarch is not installed, so backend='monarch' is unavailable. "
    "Install it with: pip install 'grpo-notebooks[monarch]'  (or pip install torchmonarch==0.7.0). "
    "backend='asyncio' runs the same code in this process."
)


def monarch_available() -> bool:
    """True when ``monarch.actor`` imports (torchmonarch installed and loadable)."""
    try:
        importlib.import_module("monarch.actor")
    except Exception:
        return False
    return True


def backend(name: str = "asyncio") -> ModuleType:
    """The module that provides the actor API: this one, or ``monarch.actor``.

    Raises ``RuntimeError`` with an install hint when Monarch is asked for but missing.
    """
    if name == "asyncio":
        return importlib.import_module("grpo_nb.actors")
    if name == "monarch":
        try:
            return importlib.import_module("monarch.actor")
        except ImportError as err:
            raise RuntimeError(MONARCH_MISSING) from err
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def class_for(cls: type, api: ModuleType) -> type:
    """The class to spawn on ``api``'s proc meshes for the module-level actor class ``cls``:
    ``cls`` itself on this runtime, its Monarch twin on ``monarch.actor``."""
    if api.__name__ == __name__:
        return cls
    from grpo_nb.actors._monarch import on_monarch_class

    return on_monarch_class(cls)
