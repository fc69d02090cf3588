"""Live plots: the toy figure from rows, re-plotting a finished run, in-place updates."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from grpo_nb import live  # noqa: E402
from grpo_nb.metrics import MetricsRecorder  # noqa: E402


def fake_run(rec: MetricsRecorder, steps: int = 20) -> None:
    for i in range(steps):
        rec.log("step", t=i * 0.1, tokens=64, step=i + 1, reward=i / steps,
                expected_reward=i / steps, loss=0.1, kl=0.01 * i, clip_frac=0.0,
                staleness=[i % 3, 0], queue_depth=1, entropy=1.4 - i / steps, zero_std_frac=0.5)
        rec.log("busy", actor="trainer", label="train", start=i * 0.1, end=i * 0.1 + 0.05)
        rec.log("busy", actor="gen0", label="generate", start=i * 0.1, end=i * 0.1 + 0.09)


def test_toy_figure_has_the_four_panels() -> None:
    rec = MetricsRecorder(None)
    fake_run(rec)
    fig = live.toy_figure(rec, optimum=1.0, random_reward=0.25)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0] == "reward" and titles[1].startswith("KL")
    assert titles[2].startswith("staleness") and titles[3].startswith("who was busy")
    reward_ax, kl_ax, stale_ax, timeline_ax = fig.axes
    assert any(line.get_ydata()[0] == 1.0 for line in reward_ax.get_lines()), "optimum line"
    assert "groups with no signal" in [t.get_text() for t in reward_ax.get_legend().get_texts()]
    kl_legend = [t.get_text() for t in kl_ax.get_legend().get_texts()]
    assert kl_legend == ["KL to reference", "policy entropy"]
    assert kl_ax.get_lines()[1].get_ydata()[0] == 1.4  # the entropy of step 1
    assert sum(p.get_height() for p in stale_ax.patches) == 40  # 20 steps x 2 samples
    assert [t.get_text() for t in timeline_ax.get_yticklabels()] == ["gen0", "trainer"]


def test_timeline_window_keeps_only_recent_intervals() -> None:
    import matplotlib.pyplot as plt

    rows = [{"actor": "a", "label": "x", "start": float(t), "end": t + 0.5} for t in range(10)]
    fig, ax = plt.subplots()
    live.plot_timeline(ax, rows, window_s=2.0)
    spans = [seg for coll in ax.collections for seg in coll.get_paths()]
    assert len(spans) == 3  # intervals ending at 7.5, 8.5, 9.5
    plt.close(fig)


def test_load_run_replots_a_finished_run(tmp_path) -> None:
    with MetricsRecorder(tmp_path / "run") as rec:
        fake_run(rec)
    fig = live.load_run(tmp_path / "run")
    assert len(fig.axes) == 4
    assert len(fig.axes[1].get_lines()[0].get_xdata()) == 20
    png = live.save_figure(rec, tmp_path / "run" / "toy.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileNotFoundError):
        live.load_run(tmp_path / "missing")


@pytest.mark.parametrize("dashboard", [False, True], ids=["toy", "llm"])
def test_live_plot_updates_in_place_and_throttles(monkeypatch, dashboard) -> None:
    from grpo_nb.llm.dashboard import LiveDashboard

    updates: list[object] = []

    class Handle:
        def update(self, obj: object) -> None:
            updates.append(obj)

    monkeypatch.setattr("IPython.display.display", lambda *a, **k: Handle())
    rec = MetricsRecorder(None)
    fake_run(rec, 5)
    plot = LiveDashboard(every_s=60, button=False) if dashboard else live.LivePlot(every_s=60)
    plot.update(rec)
    plot.update(rec)  # within every_s: skipped
    if dashboard:  # as train()'s on_event: only step and eval rows redraw
        plot("busy", rec)
        plot("step", rec)
        assert not plot.stop.is_set()
    plot.close(rec)  # the final frame is always drawn
    assert plot.frames == 2 and len(updates) == 2
    assert all(u.data[:4] == b"\x89PNG" for u in updates)
