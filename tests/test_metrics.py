"""The metrics recorder: rows in memory and in JSONL, re-loadable, resumable."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpo_nb.metrics import MetricsRecorder, load_metrics


def test_rows_reach_jsonl_and_reload(tmp_path: Path) -> None:
    with MetricsRecorder(tmp_path / "run") as rec:
        rec.log("step", step=0, reward=torch.tensor(0.25), loss=float("nan"))
        rec.log("busy", actor="trainer", label="step 0", start=rec.now(), end=rec.now())
        rec.log("step", step=1, reward=0.5)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["step", "busy", "step"]
    loaded = load_metrics(tmp_path / "run")
    assert loaded.series("step", "reward") == [0.25, 0.5]
    assert loaded.rows("step")[0]["loss"] is None  # NaN is not valid JSON
    busy = loaded.rows("busy")[0]
    assert busy["actor"] == "trainer" and busy["end"] >= busy["start"] >= 0


def test_time_is_monotonic_and_overridable() -> None:
    rec = MetricsRecorder()
    first = rec.log("a")["t"]
    second = rec.log("a")["t"]
    assert second >= first
    assert rec.log("a", t=42.0)["t"] == 42.0


def test_append_resumes_a_run(tmp_path: Path) -> None:
    with MetricsRecorder(tmp_path) as rec:
        rec.log("step", step=0, t=10.0)
    with MetricsRecorder(tmp_path, append=True) as rec:
        assert rec.series("step", "step") == [0]
        row = rec.log("step", step=1)
        assert row["t"] >= 10.0
    assert load_metrics(tmp_path).series("step", "step") == [0, 1]


def test_torn_last_line_is_tolerated_but_corruption_is_not(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "step", "t": 0}\n{"kind": "st')
    assert len(load_metrics(tmp_path).rows()) == 1
    path.write_text('{"kind": "st\n{"kind": "step", "t": 0}\n')
    with pytest.raises(ValueError, match="not JSON"):
        load_metrics(tmp_path)


def test_missing_run_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        load_metrics(tmp_path / "nope")


def test_jsonable_handles_nested_values(tmp_path: Path) -> None:
    rec = MetricsRecorder(tmp_path)
    row = rec.log("x", hist=[1.0, math.inf], d={"k": torch.tensor(2)})
    assert row["hist"] == [1.0, None] and row["d"] == {"k": 2}
    rec.close()
