"""An actor runtime in plain asyncio with torchmonarch's surface: the same module-level actor
classes spawn as ``class_for(Cls, backend("asyncio" | "monarch"))`` on either runtime.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from grpo_nb.actors._core import (
    ActorError,
    Channel,
    Future,
    Port,
    PortReceiver,
    ValueMesh,
    current_rank,
)
from grpo_nb.actors._mesh import (
    Actor,
    concurrent_endpoint,
    endpoint,
    send,
    this_host,
    this_proc,
)

__all__ = [
    "Actor", "ActorError", "Channel", "Future", "Port", "PortReceiver", "ValueMesh", "backend",
    "class_for", "concurrent_endpoint", "current_rank", "endpoint", "monarch_available", "send",
    "this_host", "this_proc",
]

MONARCH_MISSING = (
    "torchmonarch is not installed, so backend='monarch' is unavailable. "
    "Install it with: pip install 'grpo-notebooks[monarch]'  (or pip install torchmonarch==0.7.0). "
    "backend='asyncio' runs the same code in this process."
)


def monarch_available() -> bool:
    """True when ``monarch.actor`` imports."""
    try:
        importlib.import_module("monarch.actor")
    except Exception:
        return False
    return True


def backend(name: str = "asyncio") -> ModuleType:
    """The module that provides the actor API: this one, or ``monarch.actor``."""
    if name == "asyncio":
        return importlib.import_module(__name__)
    if name != "monarch":
        raise ValueError(f"backend must be 'asyncio' or 'monarch', got {name!r}")
    try:
        return importlib.import_module("monarch.actor")
    except ImportError as err:
        raise RuntimeError(MONARCH_MISSING) from err


def class_for(cls: type, api: ModuleType) -> type:
    """The class to spawn on ``api``'s proc meshes for the module-level actor class ``cls``:
    ``cls`` itself on this runtime, its Monarch twin on ``monarch.actor``."""
    if api.__name__ == __name__:
        return cls
    from grpo_nb.actors._monarch import on_monarch_class

    return on_monarch_class(cls)
