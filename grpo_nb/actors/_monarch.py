"""The same module-level actor classes on torchmonarch processes: ``on_monarch_class(Trainer)``
subclasses ``Trainer`` and ``monarch.actor.Actor`` with Monarch's endpoint decorators, published
as an attribute of this module that ``__getattr__`` (PEP 562) rebuilds in any process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import monarch.actor as monarch

from grpo_nb.actors._core import on_monarch
from grpo_nb.actors._mesh import _endpoints_of

_SEP = "__"  # module dots become this in the attribute name; no grpo_nb module name has it
_built: dict[type, type] = {}


# The wrappers reach the flag through a module-level function only: a class sent by value
# (cloudpickle) takes its wrappers' globals along, and a ContextVar does not pickle.
@contextlib.contextmanager
def _flagged() -> Iterator[None]:
    token = on_monarch.set(True)
    try:
        yield
    finally:
        on_monarch.reset(token)


def _in_monarch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with ``on_monarch`` set while it runs (tasks it starts inherit the flag)."""

    async def run_async(*args: Any, **kwargs: Any) -> Any:
        with _flagged():
            return await fn(*args, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        with _flagged():
            return fn(*args, **kwargs)

    return functools.wraps(fn)(run_async if inspect.iscoroutinefunction(fn) else run)


def on_monarch_class(cls: type) -> type:
    """The Monarch actor class for ``cls`` (one defined in a notebook or function travels by
    value, through cloudpickle)."""
    if cls in _built:
        return _built[cls]
    if cls.__module__ == "__main__" or "." in cls.__qualname__:
        # a qualname that cannot be looked up: cloudpickle sends the class by value
        module, qualname = cls.__module__, f"{cls.__qualname__}.<locals>.on_monarch"
    else:  # published here by name (see __getattr__), for pickle to find in any process
        module, qualname = __name__, cls.__module__.replace(".", _SEP) + _SEP + cls.__qualname__
    namespace: dict[str, Any] = {"__module__": module, "__qualname__": qualname,
                                 "__doc__": cls.__doc__, "__init__": _in_monarch(cls.__init__)}
    for attr, ep in _endpoints_of(cls).items():
        decorator = monarch.concurrent_endpoint if ep.concurrent else monarch.endpoint
        namespace[attr] = decorator(_in_monarch(ep.fn))
    if (cleanup := getattr(cls, "__cleanup__", None)) is not None:
        namespace["__cleanup__"] = _in_monarch(cleanup)
    _built[cls] = type(cls.__name__, (cls, monarch.Actor), namespace)
    return _built[cls]


def __getattr__(name: str) -> type:
    module, _, qualname = name.rpartition(_SEP)
    if name.startswith("_") or not module:  # dunders are Python asking, not pickle
        raise AttributeError(name)
    return on_monarch_class(getattr(importlib.import_module(module.replace(_SEP, ".")), qualname))
