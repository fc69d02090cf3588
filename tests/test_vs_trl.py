"""``benchmarks/vs_trl.py``, the race against TRL's GRPOTrainer: its arithmetic (time to an
accuracy, the headline ratio), the ring's wall-clock checkpoint option, and the race end to end
at a tiny budget (three curves and the headline key; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import benchmark

ROOT = Path(__file__).resolve().parent.parent


def _vs_trl():
    return benchmark("vs_trl")


def test_first_time_interpolates_the_first_crossing() -> None:
    first_time = _vs_trl().first_time
    curve = [[0.0, 0.3], [10.0, 0.5], [20.0, 0.4], [30.0, 0.7]]
    assert first_time(curve, 0.4) == pytest.approx(5.0)
    assert first_time(curve, 0.3) == 0.0
    assert first_time(curve, 0.6) == pytest.approx(20.0 + 10.0 * 0.2 / 0.3)
    assert first_time(curve, 0.7) == pytest.approx(30.0)
    assert first_time(curve, 0.8) is None


def test_headline_is_trls_time_over_the_modes_time() -> None:
    out = _vs_trl().headline({"trl": [[0, 0.3], [10, 0.5], [20, 0.6]],
                              "async": [[0, 0.3], [4, 0.6], [8, 0.7]],
                              "sync": [[0, 0.3], [10, 0.4]]})
    assert out["trl_final_accuracy"] == 0.6
    assert out["time_to_trl_final_s"] == {"trl": 20.0, "async": 4.0, "sync": None}
    assert out["async_speedup_vs_trl"] == 5.0 and out["sync_speedup_vs_trl"] is None


def test_checkpoint_every_s_is_validated() -> None:
    from grpo_nb.llm.config import LLMConfig

    assert LLMConfig(checkpoint_every_s=30).checkpoint_every_s == 30
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="checkpoint_every_s"):
            LLMConfig(checkpoint_every_s=bad)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_the_race_runs_end_to_end_at_a_tiny_budget(tmp_path: Path, ring_server) -> None:
    """TRL, sync and async, 4 s each, the ring's two on the session's server (``--attach``: no
    server start of the race's own): every curve starts at t = 0 with the shared evaluator's
    accuracy of the start checkpoint, and the headline keys exist."""
    pytest.importorskip("trl")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--budget-s", "4",
         "--checkpoint-every-s", "4", "--eval-size", "20", "--out", str(tmp_path / "race"),
         "--attach", ring_server.url],
        capture_output=True, text=True, timeout=1400, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert not list((tmp_path / "race").rglob("server-*.log"))  # it started no server
    assert ring_server.healthy()
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "async_speedup_vs_trl" in report and "sync_speedup_vs_trl" in report
    curves = {name: c["curve"] for name, c in report["contenders"].items()}
    assert set(curves) == {"trl", "sync", "async"}
    start = {c[0][1] for c in curves.values()}
    assert len(start) == 1  # one start checkpoint, one evaluator
    for name, curve in curves.items():
        assert curve[0][0] == 0.0 and len(curve) >= 2, (name, curve)
        assert all(0.0 <= a <= 1.0 for _, a in curve)
        assert [t for t, _ in curve] == sorted(t for t, _ in curve)
        assert report["contenders"][name]["steps"] >= 1
        assert report["contenders"][name]["completion_tokens"] > 0
        assert report["contenders"][name]["time_split"]
    assert report["eval"]["n"] == 20
    assert Path(report["png"]).is_file()
