"""The LLM ring's dashboard: live in a notebook, a PNG in a terminal, re-plotted from JSONL.

It only reads metric rows (``step``, ``eval``, ``sync``, ``dropped``, ``busy``), so a finished
run looks exactly as it did live::

    run_ring ─► MetricsRecorder ─► llm_figure(rec) ─► LiveDashboard (display handle + Stop)
                     │                              └► save_dashboard(run_dir) ─► dashboard.png
                     └─ runs/<name>/metrics.jsonl ─► live.load_run(run_dir, figure=llm_figure)
    {"async": rec_a, "sync": rec_s} ─► compare_figure() ─► reward / accuracy vs wall clock

Panel helpers (timeline, staleness histogram, series), the phase colours (one per phase, the
same as the toy ring's timeline) and ``load_run`` come from :mod:`grpo_nb.live`.
"""

from __future__ import annotations

import json
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from grpo_nb.live import legend_if_any, load_run, plot_series, plot_staleness, plot_timeline
from grpo_nb.metrics import MetricsRecorder, load_metrics


def _xy(rows: list[dict[str, Any]], key: str, x: str = "t") -> tuple[list, list]:
    pts = [(r[x], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def llm_figure(rec: MetricsRecorder, fig: Figure | None = None, *,
               window_s: float | None = 60.0) -> Figure:
    """Nine panels: reward & accuracy, KL & clip, entropy, length, tokens/s, staleness, sync,
    groups without signal & truncation, timeline."""
    if fig is None:
        fig = plt.figure(figsize=(16, 9), layout="constrained")
    fig.clear()
    axes = fig.subplot_mosaic([["reward", "kl", "entropy", "len"],
                               ["tps", "stale", "sync", "signal"],
                               ["timeline"] * 4])
    steps, evals, syncs = rec.rows("step"), rec.rows("eval"), rec.rows("sync")
    ax = axes["reward"]
    plot_series(ax, *_xy(steps, "reward"), label="train reward", smooth=10, color="tab:blue")
    plot_series(ax, *_xy(evals, "accuracy"), label="test accuracy (greedy)", color="tab:green",
                marker="o")
    ax.set(title="reward and test accuracy", xlabel="time (s)", ylim=(0, 1))
    legend_if_any(ax, fontsize=8, loc="lower right")
    ax = axes["kl"]
    plot_series(ax, *_xy(steps, "clip_frac"), label="clip fraction", color="tab:red")
    plot_series(ax, *_xy(steps, "kl"), label="KL to reference", color="tab:purple")
    ax.set(title="clip fraction and KL", xlabel="time (s)")
    legend_if_any(ax, fontsize=8)
    ax = axes["entropy"]  # towards 0: the policy stops exploring (collapse)
    plot_series(ax, *_xy(steps, "entropy"), color="tab:purple", smooth=5)
    ax.set(title="policy entropy (nats / token)", xlabel="time (s)")
    ax = axes["len"]
    plot_series(ax, *_xy(steps, "response_len"), color="tab:orange", smooth=5)
    ax.set(title="mean response length (tokens)", xlabel="time (s)")
    ax = axes["signal"]
    plot_series(ax, *_xy(steps, "zero_std_frac"), label="groups, all rewards equal",
                color="tab:gray", smooth=5)
    plot_series(ax, *_xy(steps, "truncated_frac"), label="completions cut at max_tokens",
                color="tab:red", smooth=5)
    ax.set(title="no gradient / truncated (fraction)", xlabel="time (s)", ylim=(-0.02, 1.02))
    legend_if_any(ax, fontsize=8)
    ax = axes["tps"]
    busy = rec.rows("busy")
    gen_tok = [(r["t"], r["tokens"] / max(r["train_s"], 1e-9)) for r in steps
               if r.get("train_s")]
    if len(steps) >= 2:
        xs = [r["t"] for r in steps[1:]]
        ys = [b["tokens"] / max(b["t"] - a["t"], 1e-9)
              for a, b in zip(steps[:-1], steps[1:], strict=True)]
        plot_series(ax, xs, ys, label="consumed by trainer", smooth=10, color="tab:cyan")
    if gen_tok:
        plot_series(ax, *zip(*gen_tok, strict=True), label="trainer step speed", smooth=10,
                    color="tab:gray")
    ax.set(title="tokens / s", xlabel="time (s)")
    legend_if_any(ax, fontsize=8)
    dropped = rec.rows("dropped")
    plot_staleness(axes["stale"], [s for r in steps for s in r.get("staleness", [])],
                   title=f"staleness of trained groups (dropped: {len(dropped)})")
    ax = axes["sync"]
    plot_series(ax, *_xy(syncs, "ms", "version"), marker=".", color="tab:brown")
    checked = [r for r in syncs if r.get("verified") is not None]
    ok = sum(bool(r["verified"]) for r in checked)
    ax.set(title=f"weight sync time (ms), verified {ok}/{len(checked)} checks",
           xlabel="weight version")
    plot_timeline(axes["timeline"], busy, window_s=window_s,
                  title=f"actor timeline (last {window_s:.0f} s)" if window_s else "actor timeline")
    return fig


def quiet_libraries() -> None:
    """Silence library progress bars and info logs that would clutter notebook outputs.

    A ring that runs in the notebook's process loads the policy (transformers' "Loading
    weights" bar) and writes checkpoints ("Writing model shards"); both are progress noise
    under the dashboard, not information. Errors still show.
    """
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    disable_progress_bars()


class LiveDashboard:
    """The dashboard in a notebook: one display handle updated in place, and a Stop button.

    ``stop`` (an ``asyncio.Event``) is what :func:`grpo_nb.llm.run.train` awaits; the button
    sets it, and the ring then drains, syncs, evaluates, checkpoints and returns normally.
    """

    def __init__(self, every_s: float = 2.0, *, button: bool = True) -> None:
        import asyncio

        from IPython.display import display

        quiet_libraries()  # the ring this dashboard watches loads and saves models here
        self.every_s, self.last = every_s, 0.0
        self.stop = asyncio.Event()
        if button:
            import ipywidgets as widgets

            self.button = widgets.Button(description="Stop", button_style="danger",
                                         icon="stop")
            self.button.on_click(lambda _b: self.stop.set())
            display(self.button)
        self.fig = plt.figure(figsize=(16, 9), layout="constrained")
        plt.close(self.fig)  # shown through the handle only, not again at the cell's end
        self.handle = display(self.fig, display_id=True)

    def __call__(self, kind: str, rec: MetricsRecorder) -> None:
        """``on_event`` callback for :func:`grpo_nb.llm.run.train`."""
        if kind in ("step", "eval") and time.monotonic() - self.last >= self.every_s:
            self.refresh(rec)

    def refresh(self, rec: MetricsRecorder) -> None:
        llm_figure(rec, self.fig)
        self.handle.update(self.fig)
        self.last = time.monotonic()


def save_dashboard(run_dir: Path | str, name: str = "dashboard.png") -> Path:
    """Re-plot a run folder's metrics as a PNG next to them (timeline: the last minute)."""
    fig = load_run(run_dir, figure=llm_figure, window_s=60.0)
    path = Path(run_dir) / name
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def compare_figure(runs: dict[str, MetricsRecorder]) -> Figure:
    """Reward and test accuracy against wall-clock time, one line per run (e.g. async/sync)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
    for label, rec in runs.items():
        plot_series(a, *_xy(rec.rows("step"), "reward", "wall_s"), label=label, smooth=10)
        evals = rec.rows("eval")
        t0 = rec.rows("step")[0]["t"] - rec.rows("step")[0]["wall_s"] if rec.rows("step") else 0
        plot_series(b, [r["t"] - t0 for r in evals], [r["accuracy"] for r in evals],
                    label=label, marker="o")
    a.set(title="train reward vs wall clock", xlabel="seconds of training", ylim=(0, 1))
    b.set(title="test accuracy vs wall clock", xlabel="seconds of training", ylim=(0, 1))
    legend_if_any(a)
    legend_if_any(b)
    return fig


# ── recorded runs: the workshop path (notebooks/recorded/<name>/) ──


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def record_run(run_dir: Path | str, dest: Path | str, *, busy_window_s: float = 30.0) -> Path:
    """Copy a finished run into ``dest`` small enough to ship: every row but the ``busy`` rows
    older than the last ``busy_window_s`` seconds (the dashboard's timeline shows a window),
    floats to 4 decimals; plus ``result.json`` and ``config.json``."""
    rows = load_metrics(run_dir).rows()
    busy_end = max((r["end"] for r in rows if r["kind"] == "busy"), default=0.0)
    kept = [{k: _rounded(v) for k, v in r.items()} for r in rows
            if r["kind"] != "busy" or r["end"] >= busy_end - busy_window_s]
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    for name in ("result.json", "config.json"):
        data = json.loads((Path(run_dir) / name).read_text())
        data.pop("run_dir", None)  # a path on the recording machine
        (dest / name).write_text(json.dumps(data, indent=1) + "\n")
    return dest


def recorded_run(folder: Path | str) -> tuple[Any, MetricsRecorder]:
    """``(RunResult, metrics)`` of a run saved by :func:`record_run` (or any run folder):
    what ``train()`` would have returned, re-plotted by the same figures."""
    from grpo_nb.llm.summary import RunResult

    data = json.loads((Path(folder) / "result.json").read_text())
    known = {f.name for f in fields(RunResult)}
    result = RunResult(**{k: v for k, v in data.items() if k in known})
    result.run_dir = str(folder)
    return result, load_metrics(folder)
