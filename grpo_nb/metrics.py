"""A metrics recorder: rows (a ``kind`` and a time ``t`` in seconds) in memory, mirrored line by
line to ``runs/<name>/metrics.jsonl``, from which a finished run re-plots exactly.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from grpo_nb.config import json_lines, runs_dir


def _jsonable(value: Any) -> Any:
    """Tensors and numpy scalars become plain numbers; NaN and inf become None (valid JSON)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


class MetricsRecorder:
    """Metric rows, each written to ``run_dir/metrics.jsonl`` if given; ``append``: resume."""

    def __init__(self, run_dir: Path | str | None = None, *, append: bool = False) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._rows: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()
        self._file = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            path = self.run_dir / "metrics.jsonl"
            if append and path.exists():
                self._rows = _read_jsonl(path)
                # Keep time monotonic across a resume: continue after the last row's time.
                self._t0 -= max((r.get("t", 0.0) or 0.0 for r in self._rows), default=0.0)
            self._file = path.open("a" if append else "w", encoding="utf-8")

    @classmethod
    def for_run(cls, name: str, *, append: bool = False) -> MetricsRecorder:
        """A recorder writing to ``runs/<name>/`` (see :func:`grpo_nb.config.runs_dir`)."""
        return cls(runs_dir() / name, append=append)

    def now(self) -> float:
        """Seconds since this recorder started (the ``t`` of a row logged now)."""
        return time.perf_counter() - self._t0

    def log(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record one row of ``kind``; ``t`` defaults to now. Returns the stored row."""
        t = fields.pop("t", None)
        row = {"kind": kind, "t": self.now() if t is None else t}
        row.update({k: _jsonable(v) for k, v in fields.items()})
        self._rows.append(row)
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        return row

    def rows(self, kind: str | None = None) -> list[dict[str, Any]]:
        """All rows, or those of one kind, in the order they were logged."""
        return [r for r in self._rows if kind is None or r["kind"] == kind]

    def series(self, kind: str, key: str) -> list[Any]:
        """The values of ``key`` over the rows of ``kind`` that have it."""
        return [r[key] for r in self._rows if r["kind"] == kind and key in r]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    text, rows = path.read_text(encoding="utf-8"), []
    try:
        for _, row in json_lines(text):
            rows.append(row)
    except json.JSONDecodeError as err:
        # A run killed mid-write leaves a torn last line; anything else is corruption.
        if "\n" in text[err.pos:].removesuffix("\n"):
            raise ValueError(f"{path}:{err.lineno}: not JSON ({err.msg}, column {err.colno})"
                             ) from None
    return rows


def load_metrics(run_dir: Path | str) -> MetricsRecorder:
    """A finished (or interrupted) run's ``metrics.jsonl`` in an in-memory recorder."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}: is this a run folder?")
    rec = MetricsRecorder(None)
    rec._rows, rec.run_dir = _read_jsonl(path), Path(run_dir)
    return rec
