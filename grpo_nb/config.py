"""Where the package keeps things (``GRPO_NB_CACHE``, ``GRPO_NB_RUNS``), and smoke mode
(``GRPO_NB_SMOKE``: :func:`preset` picks each config's small ``smoke()`` preset), and
:class:`InputError`, the bad input a command reports in one line.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TypeVar

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class InputError(ValueError):
    """Bad input the user fixes (a dataset file, a run folder): the message names the file, the
    line or field, and what was expected. ``python -m grpo_nb train`` prints it as one
    ``error:`` line and exits 2; it is raised before any server starts."""


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
    """The project cache: tiny models, tokenizers, vLLM's compile cache."""
    return _folder("GRPO_NB_CACHE", ".cache", Path.home() / ".cache" / "grpo-nb")


def runs_dir() -> Path:
    """Where runs are written: ``runs/<name>/`` holds metrics.jsonl, plots and checkpoints."""
    return _folder("GRPO_NB_RUNS", "runs", Path.cwd() / "runs")


def unique_run_name(prefix: str) -> str:
    """``prefix-YYYYmmdd-HHMMSS-pid``: two runs at once (a notebook and a test) never share a file."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
