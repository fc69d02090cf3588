"""Where the package keeps things, and whether it runs in smoke mode.

Smoke mode is read here and nowhere else: every config dataclass in the package offers a
``smoke()`` preset, and notebooks pick it with :func:`preset`. CI sets ``GRPO_NB_SMOKE=1`` so
that every notebook runs the real code path at a small size.

Folders::

    project cache   GRPO_NB_CACHE   default: <repo>/.cache when run from a checkout,
                                     else ~/.cache/grpo-nb
    runs            GRPO_NB_RUNS    default: <repo>/runs, else ./runs
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, TypeVar

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def env_flag(name: str) -> bool:
    """The boolean environment variable ``name`` (unset: False).

    Raises ``ValueError`` on a value that is neither truthy nor falsy, so that a typo such as
    ``GRPO_NB_SMOKE=ture`` does not silently run the other configuration.
    """
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: use 1/0, true/false, yes/no or on/off")


def smoke_mode() -> bool:
    """True when ``GRPO_NB_SMOKE`` asks for the small CI configuration (see :func:`env_flag`)."""
    return env_flag("GRPO_NB_SMOKE")


class _HasSmoke(Protocol):
    @classmethod
    def smoke(cls): ...


C = TypeVar("C", bound=_HasSmoke)


def preset(config_cls: type[C], smoke: bool | None = None) -> C:
    """Return ``config_cls.smoke()`` in smoke mode, else the full default ``config_cls()``."""
    use_smoke = smoke_mode() if smoke is None else smoke
    return config_cls.smoke() if use_smoke else config_cls()


def repo_root() -> Path | None:
    """The checkout this package was installed from (editable install), if any."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").is_file() else None


def cache_dir() -> Path:
    """The project cache: tiny models, tokenizers, vLLM's compile cache."""
    env = os.environ.get("GRPO_NB_CACHE")
    if env:
        path = Path(env).expanduser()
    elif (root := repo_root()) is not None:
        path = root / ".cache"
    else:
        path = Path.home() / ".cache" / "grpo-nb"
    path.mkdir(parents=True, exist_ok=True)
    return path


def runs_dir() -> Path:
    """Where runs are written: ``runs/<name>/`` holds metrics.jsonl, plots and checkpoints."""
    env = os.environ.get("GRPO_NB_RUNS")
    if env:
        path = Path(env).expanduser()
    elif (root := repo_root()) is not None:
        path = root / "runs"
    else:
        path = Path.cwd() / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path
