"""The same module-level actor classes on torchmonarch processes: ``on_monarch_class(Trainer)``
subclasses ``Trainer`` and ``monarch.actor.Actor`` with Monarch's endpoint decorators, published
as an attribute of this module that ``__getattr__`` (PEP 562) rebuilds in any process.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import monarch.actor as monarch

from grpo_nb.actors._core import on_monarch
from grpo_nb.actors._mesh import Actor, _endpoints_of

_SEP = "__"  # module dots become this in the attribute name; no grpo_nb module name has it
_built: dict[str, type] = {}


# The wrappers reach the flag through module-level functions only: a class sent by value
# (cloudpickle) takes its wrappers' globals along, and a ContextVar does not pickle.
def _enter() -> contextvars.Token:
    return on_monarch.set(True)


def _leave(token: contextvars.Token) -> None:
    on_monarch.reset(token)


def _in_monarch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with ``on_monarch`` set while it runs (tasks it starts inherit the flag)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            token = _enter()
            try:
                return await fn(*args, **kwargs)
            finally:
                _leave(token)

        return run_async

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = _enter()
        try:
            return fn(*args, **kwargs)
        finally:
            _leave(token)

    return run


def _build(cls: type, module: str, qualname: str) -> type:
    namespace: dict[str, Any] = {"__module__": module, "__qualname__": qualname,
                                 "__doc__": cls.__doc__, "__init__": _in_monarch(cls.__init__)}
    for attr, ep in _endpoints_of(cls).items():
        decorator = monarch.concurrent_endpoint if ep.concurrent else monarch.endpoint
        namespace[attr] = decorator(_in_monarch(ep.fn))
    if (cleanup := getattr(cls, "__cleanup__", None)) is not None:
        namespace["__cleanup__"] = _in_monarch(cleanup)
    return type(cls.__name__, (cls, monarch.Actor), namespace)


def on_monarch_class(cls: type) -> type:
    """The Monarch actor class for ``cls`` (one defined in a notebook or function travels by
    value, through cloudpickle)."""
    if cls.__module__ == "__main__" or "." in cls.__qualname__:
        key = f"{cls.__module__}:{cls.__qualname__}:{id(cls)}"
        if key not in _built:  # a qualname that cannot be looked up: cloudpickle sends it by value
            _built[key] = _build(cls, cls.__module__, f"{cls.__qualname__}.<locals>.on_monarch")
        return _built[key]
    name = cls.__module__.replace(".", _SEP) + _SEP + cls.__qualname__
    if name not in _built:
        _built[name] = _build(cls, __name__, name)
    return _built[name]


def __getattr__(name: str) -> type:
    module, sep, qualname = name.rpartition(_SEP)
    if name.startswith("_") or not sep or not module:  # dunders are Python asking, not pickle
        raise AttributeError(name)
    cls = getattr(importlib.import_module(module.replace(_SEP, ".")), qualname)
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise AttributeError(name)
    return on_monarch_class(cls)
