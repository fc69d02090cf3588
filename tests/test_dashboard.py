"""The LLM dashboard re-plots a run from its rows: live, as PNG, and from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from grpo_nb.live import load_run  # noqa: E402
from grpo_nb.llm.dashboard import compare_figure, llm_figure, save_dashboard  # noqa: E402
from grpo_nb.metrics import MetricsRecorder  # noqa: E402


def _fake_run(run_dir: Path | None, *, mode: str = "async") -> MetricsRecorder:
    rec = MetricsRecorder(run_dir)
    rec.log("eval", t=0.5, step=0, accuracy=0.30)
    for step in range(1, 21):
        t = float(step)
        rec.log("busy", t=t, actor="gen0", label="generate", start=t - 0.9, end=t - 0.1)
        rec.log("busy", t=t, actor="trainer", label="train",
                start=t - (0.5 if mode == "async" else 0.05), end=t)
        rec.log("step", t=t, step=step, reward=0.1 + step / 100, kl=0.0, clip_frac=0.01,
                response_len=5.0, tokens=640, train_s=0.4, wall_s=t,
                staleness=[1, 1, 0, 2] if mode == "async" else [0, 0, 0, 0])
        rec.log("sync", t=t, step=step, version=step, ms=120.0 + step,
                verified=True if step % 5 == 0 else None)
    rec.log("dropped", t=7.0, step=7, staleness=3, total=1)
    rec.log("eval", t=20.5, step=20, accuracy=0.41)
    return rec


def test_figure_has_every_panel_and_reports_drops_and_verification() -> None:
    fig = llm_figure(_fake_run(None), window_s=None)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == 7
    assert any("dropped: 1" in t for t in titles)
    assert any("weight sync" in t and "verified 4/4 checks" in t for t in titles)
    timeline = next(ax for ax in fig.axes if ax.get_title().startswith("actor timeline"))
    assert [t.get_text() for t in timeline.get_yticklabels()] == ["gen0", "trainer"]


def test_saved_run_replots_from_jsonl(tmp_path: Path) -> None:
    rec = _fake_run(tmp_path / "run")
    rec.close()
    png = save_dashboard(tmp_path / "run")
    assert png.is_file() and png.stat().st_size > 10_000
    fig = load_run(tmp_path / "run", figure=llm_figure)
    reward_ax = fig.axes[0]
    xs = reward_ax.lines[0].get_xdata()
    assert len(xs) == 20  # every logged step came back from the file


def test_compare_figure_one_line_per_mode() -> None:
    fig = compare_figure({"async": _fake_run(None), "sync": _fake_run(None, mode="sync")})
    left, right = fig.axes
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["async", "sync"]
    assert len(right.lines) == 2
