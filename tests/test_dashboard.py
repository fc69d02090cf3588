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
                entropy=2.0 - step / 20, zero_std_frac=0.25, truncated_frac=step / 40,
                staleness=[1, 1, 0, 2] if mode == "async" else [0, 0, 0, 0])
        rec.log("sync", t=t, step=step, version=step, ms=120.0 + step,
                verified=True if step % 5 == 0 else None)
    rec.log("dropped", t=7.0, step=7, staleness=3, total=1)
    rec.log("eval", t=20.5, step=20, accuracy=0.41)
    return rec


def test_figure_has_every_panel_and_reports_drops_and_verification() -> None:
    fig = llm_figure(_fake_run(None), window_s=None)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == 11  # the token-lag and TIS panels: tests/test_token_versions.py
    assert any("dropped: 1" in t for t in titles)
    panels = {ax.get_label(): ax for ax in fig.axes}  # subplot_mosaic names each panel
    assert list(panels["entropy"].lines[0].get_ydata())[-1] == 1.0  # entropy of step 20
    legend = [t.get_text() for t in panels["signal"].get_legend().get_texts()]
    assert legend == ["groups, all rewards equal", "completions cut at max_tokens"]
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


def _legend_colours(ax) -> dict[str, tuple]:
    legend = ax.get_legend()
    assert legend is not None
    return {t.get_text(): tuple(h.get_facecolor())
            for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)}


def _timeline(fig):
    return next(ax for ax in fig.axes if "timeline" in ax.get_title()
                or ax.get_title().startswith("who was busy"))


def test_a_phase_keeps_its_colour_across_refreshes_and_figures() -> None:
    # 05's bug: colours were assigned by position among the labels present, so "sync" changed
    # colour when "eval" and "score" entered the plotted window.
    from matplotlib.colors import to_rgba

    from grpo_nb.live import PHASE_COLORS, toy_figure

    rec = MetricsRecorder(None)
    for actor, label, start in [("gen0", "generate", 0.0), ("trainer", "train", 1.0),
                                ("trainer", "sync", 2.0)]:
        rec.log("busy", t=start + 1, actor=actor, label=label, start=start, end=start + 0.5)
    first = _legend_colours(_timeline(llm_figure(rec, window_s=None)))
    for actor, label, start in [("scorer", "score", 3.0), ("trainer", "eval", 4.0),
                                ("reference", "ref logp", 5.0), ("trainer", "sync", 6.0)]:
        rec.log("busy", t=start + 1, actor=actor, label=label, start=start, end=start + 0.5)
    second = _legend_colours(_timeline(llm_figure(rec, window_s=None)))
    toy = _legend_colours(_timeline(toy_figure(rec, window_s=None)))
    assert set(first) == {"generate", "train", "sync"} and len(second) == 6
    for label, colour in second.items():
        assert colour == to_rgba(PHASE_COLORS[label]), label
        assert toy[label] == colour, label
        if label in first:
            assert first[label] == colour, label
    assert len(set(second.values())) == len(second)  # no two phases share a colour


def test_no_empty_legend_warning_on_first_refreshes(recwarn) -> None:
    # The first refresh of a live run has an eval row and no step yet: panels without a
    # labelled line must not ask for a legend (matplotlib then warns, a box in the notebook).
    rec = MetricsRecorder(None)
    llm_figure(rec)
    rec.log("eval", t=0.5, step=0, accuracy=0.3)
    llm_figure(rec)
    rec.log("step", t=1.0, step=1, reward=0.2, kl=0.0, clip_frac=0.0, response_len=5.0,
            tokens=64, wall_s=1.0, staleness=[0])
    llm_figure(rec)
    compare_figure({"async": MetricsRecorder(None)})
    noisy = [str(w.message) for w in recwarn if "No artists with labels" in str(w.message)]
    assert noisy == []


def test_live_dashboard_silences_library_progress_bars() -> None:
    from transformers.utils import logging as hf_logging

    from grpo_nb.llm.dashboard import quiet_libraries

    hf_logging.enable_progress_bar()
    try:
        quiet_libraries()
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity_warning()


RECORDED = Path(__file__).resolve().parent.parent / "notebooks" / "recorded"


def test_record_run_keeps_every_metric_row_and_a_window_of_busy_rows(tmp_path: Path) -> None:
    from grpo_nb.llm.dashboard import record_run, recorded_run

    rec = _fake_run(tmp_path / "run")
    rec.close()
    (tmp_path / "run" / "result.json").write_text(
        '{"steps": 20, "accuracy_before": 0.3, "accuracy_after": 0.41, "wall_s": 20.0, '
        '"sync_ms_mean": 130.0, "stale_dropped": 1, "weights_verified": true, '
        '"run_dir": "/somewhere/else", "not_a_field": 1}')
    (tmp_path / "run" / "config.json").write_text('{"mode": "async"}')
    out = record_run(tmp_path / "run", tmp_path / "rec", busy_window_s=5.0)
    result, rows = recorded_run(out)
    assert result.steps == 20 and result.accuracy_after == 0.41
    assert result.run_dir == str(out)  # not the recording machine's path
    assert len(rows.rows("step")) == 20 and len(rows.rows("eval")) == 2
    assert min(r["end"] for r in rows.rows("busy")) >= 20.0 - 5.0
    assert len(rows.rows("busy")) < len(rec.rows("busy"))


def test_shipped_recordings_are_small_and_replot() -> None:
    # The workshop path of notebook 05 (USE_RECORDED = True) replays these instead of training.
    from grpo_nb.llm.dashboard import recorded_run

    for name in ("nb05-async", "nb05-sync", "nb05-stale0"):
        folder = RECORDED / name
        # 100 steps with every busy interval of the timeline: about 0.6 MB
        assert (folder / "metrics.jsonl").stat().st_size < 1_000_000, name
        result, rec = recorded_run(folder)
        assert result.steps == rec.rows("step")[-1]["step"], name
        assert result.weights_verified, name
        llm_figure(rec, window_s=30)
    # what notebook 05 teaches from them: tests/test_recorded.py

