"""Where the package keeps things (``GRPO_NB_CACHE``, ``GRPO_NB_RUNS``), smoke mode
(``GRPO_NB_SMOKE``: :func:`preset` picks each config's small ``smoke()`` preset),
:class:`InputError` (the bad input a command reports in one line), and the configs' one
validation rule: each field is checked against its annotation (:func:`check_fields`) and read
from ``--set FIELD=VALUE`` by it (:func:`parse_sets`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import time
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

from annotated_types import Ge, Gt, Le, Lt  # noqa: F401 (Lt: for the configs' own bounds)

# Field annotations the configs share (bounds as pydantic reads them; NaN fails every bound).
PosInt = Annotated[int, Ge(1)]
NonNegInt = Annotated[int, Ge(0)]
PosFloat = Annotated[float, Gt(0)]
NonNegFloat = Annotated[float, Ge(0)]
Fraction = Annotated[float, Gt(0), Le(1)]  # (0, 1]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class InputError(ValueError):
    """Bad input the user fixes (a dataset file, a run folder): the message names the file, the
    line or field, and what was expected. ``python -m grpo_nb train`` prints it as one
    ``error:`` line and exits 2; it is raised before any server starts."""


def utf8_text(path: Path) -> str:
    """``path``'s text, or ``ValueError("line N: not UTF-8 text (byte B)")``."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise ValueError(f"line {line}: not UTF-8 text (byte {err.start})") from None


def json_where(err: json.JSONDecodeError) -> str:
    """Where a text stops being JSON, as the errors about a file name it."""
    return f"line {err.lineno} column {err.colno}: {err.msg}"


def json_lines(text: str) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line of JSON Lines ``text``; a line that is not
    JSON raises ``json.JSONDecodeError`` placed in the whole text (its ``lineno``: the file's)."""
    start = 0
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise json.JSONDecodeError(err.msg, text, start + err.pos) from None
        start += len(line) + 1


def env_flag(name: str) -> bool:
    """The boolean environment variable ``name`` (unset: False; a typo raises)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: use 1/0, true/false, yes/no or on/off")


def smoke_mode() -> bool:
    """True when ``GRPO_NB_SMOKE`` asks for the small CI configuration."""
    return env_flag("GRPO_NB_SMOKE")


C = TypeVar("C")  # a config dataclass with a ``smoke()`` classmethod


def preset(config_cls: type[C], smoke: bool | None = None) -> C:
    """``config_cls.smoke()`` in smoke mode, else the full default ``config_cls()``."""
    use_smoke = smoke_mode() if smoke is None else smoke
    return config_cls.smoke() if use_smoke else config_cls()


@functools.cache
def _adapters(cls: type) -> dict[str, Any]:
    import pydantic

    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: pydantic.TypeAdapter(hints[f.name]) for f in dataclasses.fields(cls)}


def _why(err: Any) -> str:
    return err.errors()[0]["msg"].replace("Input should be", "must be")


def check_fields(cfg: Any) -> None:
    """Check each field of the dataclass ``cfg`` against its annotation as pydantic reads it in
    strict mode (the type, a ``Literal``'s choices, ``Annotated`` bounds); the first that fails
    raises ``ValueError("ToyConfig.clip=1.5: must be less than 1")``."""
    import pydantic

    for name, adapter in _adapters(type(cfg)).items():
        value = getattr(cfg, name)
        try:
            adapter.validate_python(value, strict=True)
        except pydantic.ValidationError as err:
            raise ValueError(f"{type(cfg).__name__}.{name}={value!r}: {_why(err)}") from None


def parse_sets(cls: type, assignments: Iterable[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` items as ``{FIELD: value}`` for the config class ``cls``, each value
    read by its field's annotation (JSON first, then pydantic's lax rules for text: ``yes``,
    ``1e-5``; ``none``); ``SUB.FIELD`` names a field of a config-typed field (``sync.verify``).
    A ``ValueError`` names the item; the config checks the values it is built with."""
    import pydantic

    values: dict[str, Any] = {}
    for item in assignments:
        name, eq, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        owner, head, _, sub = cls, *name.partition(".")
        if sub:  # SUB.FIELD: a field of the config-typed field SUB
            owner, head = typing.get_type_hints(cls).get(head), sub
        adapter = _adapters(owner).get(head) if dataclasses.is_dataclass(owner) else None
        if not eq or adapter is None:
            raise ValueError(f"--set {item!r}: " + ("write FIELD=VALUE" if not eq else
                             f"{cls.__name__} has no field {name!r}") +
                             f" (fields: {', '.join(_adapters(cls))})")
        if adapter.core_schema["type"] == "any":  # the config validates it
            values[name] = raw
            continue
        with contextlib.suppress(pydantic.ValidationError):
            values[name] = adapter.validate_json(raw)
            continue
        try:
            text = None if raw.strip().lower() in ("none", "null") else raw
            values[name] = adapter.validate_python(text)
        except pydantic.ValidationError as err:
            raise ValueError(f"--set {name}={raw!r}: {owner.__name__}.{head} {_why(err)}") \
                from None
    return values


def given_fields(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options given (not None) whose ``dest`` is a field of the config class ``cls``, or
    ``SUB.FIELD``: a field of its config-typed field ``SUB`` (``--transport``: sync.transport)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items()
            if v is not None and k.partition(".")[0] in names}


def repo_root() -> Path | None:
    """The checkout this package was installed from (editable install), if any."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").is_file() else None


def _folder(env: str, in_repo: str, elsewhere: Path) -> Path:
    """``$env``, else ``<repo>/in_repo`` in a checkout, else ``elsewhere``; created."""
    if os.environ.get(env):
        path = Path(os.environ[env]).expanduser()
    else:
        root = repo_root()
        path = root / in_repo if root is not None else elsewhere
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """The project cache: tiny models, tokenizers, ``VLLM_CACHE_ROOT`` (compiled kernels: CUDA only)."""
    return _folder("GRPO_NB_CACHE", ".cache", Path.home() / ".cache" / "grpo-nb")


def runs_dir() -> Path:
    """Where runs are written: ``runs/<name>/`` holds metrics.jsonl, plots and checkpoints."""
    return _folder("GRPO_NB_RUNS", "runs", Path.cwd() / "runs")


def unique_run_name(prefix: str) -> str:
    """``prefix-YYYYmmdd-HHMMSS-pid``: two runs at once (a notebook and a test) never share a file."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
