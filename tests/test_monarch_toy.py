"""The toy ring on real torchmonarch processes: same actors, only the backend changes."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

import grpo_nb.actors
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.toy import ToyConfig, run_ring

pytestmark = [pytest.mark.monarch, pytest.mark.slow]


def test_toy_ring_runs_on_monarch_processes() -> None:
    if not grpo_nb.actors.monarch_available():
        pytest.fail("torchmonarch is not importable; deselect with -m 'not monarch'")
    cfg = replace(ToyConfig.smoke(), backend="monarch", steps=25)
    rec = MetricsRecorder(None)
    result = asyncio.run(asyncio.wait_for(run_ring(cfg, rec), 240))
    assert result.backend == "monarch" and result.steps == 25
    rows = rec.rows("step")
    assert [r["step"] for r in rows] == list(range(1, 26))
    assert all(r["queue_depth"] is None for r in rows), "Monarch's receiver has no qsize()"
    assert {"gen0", "gen3", "scorer", "reference", "trainer"} <= {r["actor"] for r in rec.rows("busy")}
    assert min(s for r in rows for s in r["staleness"]) >= 0
