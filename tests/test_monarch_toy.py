"""The toy ring on real torchmonarch processes: same actors, only the backend changes."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

import grpo_nb.actors
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.toy.run import run_ring
from grpo_nb.toy.task import ToyConfig

pytestmark = [pytest.mark.monarch, pytest.mark.slow]


def test_toy_ring_runs_on_monarch_processes() -> None:
    if not grpo_nb.actors.monarch_available():
        pytest.fail("torchmonarch is not importable; deselect with -m 'not monarch'")
    # 2 generators + one shared process for the other stages: 3 processes to start, not 7
    # (the seed test in test_actors_seed.py already covers Monarch's one-process-per-role layout).
    cfg = replace(ToyConfig.smoke(), backend="monarch", steps=25, generators=2, layout="shared")
    rec = MetricsRecorder(None)
    result = asyncio.run(asyncio.wait_for(run_ring(cfg, rec), 240))
    assert result.backend == "monarch" and result.steps == 25
    rows = rec.rows("step")
    assert [r["step"] for r in rows] == list(range(1, 26))
    assert all(r["queue_depth"] is None for r in rows), "Monarch's receiver has no qsize()"
    assert {"gen0", "gen1", "scorer", "reference", "trainer"} <= {r["actor"] for r in rec.rows("busy")}
    assert min(s for r in rows for s in r["staleness"]) >= 0


def test_module_level_actor_classes_travel_by_name_to_monarch_processes() -> None:
    """The Monarch twin of a module-level class is found again by pickle in any process
    (what lets Monarch start it elsewhere); on asyncio the class itself is spawned."""
    import pickle

    from grpo_nb.actors import class_for
    from grpo_nb.toy.actors import Trainer

    if not grpo_nb.actors.monarch_available():
        pytest.fail("torchmonarch is not importable; deselect with -m 'not monarch'")
    assert class_for(Trainer, grpo_nb.actors.backend("asyncio")) is Trainer
    twin = class_for(Trainer, grpo_nb.actors.backend("monarch"))
    import monarch.actor

    assert issubclass(twin, Trainer) and issubclass(twin, monarch.actor.Actor)
    assert pickle.loads(pickle.dumps(twin)) is twin
    assert twin.__module__ == "grpo_nb.actors._monarch"
