"""Scripts of ``benchmarks/`` (a folder, not a package) imported as modules, for the tests of
their pieces."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module. ``benchmarks/`` is on ``sys.path`` only while it
    loads: a test whose code imports more of that folder later (a spawned child) puts it there
    itself."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
