"""The LLM ring's dashboard (live, PNG, re-plotted), the async-vs-sync comparison, and recorded
runs small enough to ship with the notebooks."""

from __future__ import annotations

import asyncio
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from grpo_nb.live import (
    LivePlot,
    legend_if_any,
    plot_series,
    plot_staleness,
    plot_timeline,
    save_figure,
    series,
)
from grpo_nb.metrics import MetricsRecorder, load_metrics


def llm_figure(rec: MetricsRecorder, fig: Figure | None = None, *,
               window_s: float | None = 60.0) -> Figure:
    """The LLM run's panels (reward, KL, entropy, speed, staleness, sync, token lag, TIS …)
    and timeline."""
    if fig is None:
        fig = plt.figure(figsize=(16, 11), layout="constrained")
    fig.clear()
    axes = fig.subplot_mosaic([["reward", "kl", "entropy", "len"],
                               ["tps", "stale", "sync", "signal"],
                               ["lag", "lag", "tis", "tis"],
                               ["timeline"] * 4])
    steps, evals, syncs = rec.rows("step"), rec.rows("eval"), rec.rows("sync")
    ax = axes["reward"]
    plot_series(ax, *series(steps, "reward"), label="train reward", smooth=10, color="tab:blue")
    plot_series(ax, *series(evals, "accuracy"), label="test accuracy (greedy)", color="tab:green",
                marker="o")
    ax.set(title="reward and test accuracy", xlabel="time (s)", ylim=(0, 1))
    legend_if_any(ax, fontsize=8, loc="lower right")
    ax = axes["kl"]
    plot_series(ax, *series(steps, "clip_frac"), label="clip fraction", color="tab:red")
    plot_series(ax, *series(steps, "kl"), label="KL to reference", color="tab:purple")
    ax.set(title="clip fraction and KL", xlabel="time (s)")
    legend_if_any(ax, fontsize=8)
    ax = axes["entropy"]  # towards 0: the policy stops exploring (collapse)
    plot_series(ax, *series(steps, "entropy"), color="tab:purple", smooth=5)
    ax.set(title="policy entropy (nats / token)", xlabel="time (s)")
    ax = axes["len"]
    plot_series(ax, *series(steps, "response_len"), color="tab:orange", smooth=5)
    ax.set(title="mean response length (tokens)", xlabel="time (s)")
    ax = axes["signal"]
    plot_series(ax, *series(steps, "zero_std_frac"), label="groups, all rewards equal",
                color="tab:gray", smooth=5)
    plot_series(ax, *series(steps, "truncated_frac"), label="completions cut at max_tokens",
                color="tab:red", smooth=5)
    ax.set(title="no gradient / truncated (fraction)", xlabel="time (s)", ylim=(-0.02, 1.02))
    legend_if_any(ax, fontsize=8)
    ax = axes["tps"]
    pairs = list(zip(steps, steps[1:], strict=False))
    plot_series(ax, [b["t"] for _, b in pairs],
                [b["tokens"] / max(b["t"] - a["t"], 1e-9) for a, b in pairs], label="consumed by trainer", smooth=10, color="tab:cyan")
    timed = [r for r in steps if r.get("train_s")]
    plot_series(ax, [r["t"] for r in timed], [r["tokens"] / r["train_s"] for r in timed],
                label="trainer step speed", smooth=10, color="tab:gray")
    ax.set(title="tokens / s", xlabel="time (s)")
    legend_if_any(ax, fontsize=8)
    plot_staleness(axes["stale"], [s for r in steps for s in r.get("staleness", [])],
                   title=f"staleness of trained groups (dropped: {len(rec.rows('dropped'))})")
    ax = axes["sync"]
    plot_series(ax, *series(syncs, "ms", "version"), marker=".", color="tab:brown")
    checked = [r for r in syncs if r.get("verified") is not None]
    ok = sum(bool(r["verified"]) for r in checked)
    ax.set(title=f"weight sync time (ms), verified {ok}/{len(checked)} checks",
           xlabel="weight version")
    plot_token_lag(axes["lag"], steps)
    ax = axes["tis"]  # with ratio_against="trainer" the whole off-policy correction is here
    plot_series(ax, *series(steps, "tis_weight_mean"), label="TIS weight, mean", color="tab:blue")
    plot_series(ax, *series(steps, "tis_capped_frac"), label="TIS weights at tis_cap (fraction)",
                color="tab:red")
    plot_series(ax, *series(steps, "ratio_max"), label="largest ratio π_θ / π_old",
                color="tab:gray")
    ax.set(title="truncated importance sampling and the largest PPO ratio", xlabel="time (s)")
    legend_if_any(ax, fontsize=8)
    plot_timeline(axes["timeline"], rec.rows("busy"), window_s=window_s,
                  title=f"actor timeline (last {window_s:.0f} s)" if window_s else "actor timeline")
    return fig


def plot_token_lag(ax: Any, steps: list[dict[str, Any]]) -> None:
    """A heat-map: for each step (x), the share of its tokens sampled ``k`` versions behind the
    trainer (y), from the rows' ``token_lag_counts``."""
    rows = [r for r in steps if r.get("token_lag_counts")]
    mixed = [r["mixed_version_frac"] for r in steps if "mixed_version_frac" in r]
    if rows:
        depth = max(len(r["token_lag_counts"]) for r in rows)
        shares = [[c / max(sum(r["token_lag_counts"]), 1) for c in r["token_lag_counts"]]
                  + [0.0] * (depth - len(r["token_lag_counts"])) for r in rows]
        image = ax.imshow(list(map(list, zip(*shares, strict=True))), aspect="auto",
                          origin="lower", cmap="Purples", vmin=0.0, vmax=1.0,
                          interpolation="nearest", extent=(rows[0]["step"] - 0.5,
                                                           rows[-1]["step"] + 0.5, -0.5,
                                                           depth - 0.5))
        image.set_label("token lag shares")
        ax.set_yticks(range(depth))
    split = f", completions split by a sync: {sum(mixed) / len(mixed):.0%}" if mixed else ""
    ax.set(title=f"token lag (share of each step's tokens){split}", xlabel="step",
           ylabel="versions behind")


def quiet_libraries() -> None:
    """Silence transformers' and the hub's progress bars and info logs (errors still show)."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    disable_progress_bars()


class LiveDashboard(LivePlot):
    """The dashboard in a notebook, with a Stop button that sets ``stop`` (an ``asyncio.Event``)."""

    def __init__(self, every_s: float = 2.0, *, button: bool = True) -> None:
        from IPython.display import display

        quiet_libraries()  # the ring this dashboard watches loads and saves models here
        self.stop = asyncio.Event()
        if button:
            import ipywidgets as widgets

            self.button = widgets.Button(description="Stop", button_style="danger", icon="stop")
            self.button.on_click(lambda _b: self.stop.set())
            display(self.button)
        super().__init__(llm_figure, every_s=every_s, dpi=80)

    def __call__(self, kind: str, rec: MetricsRecorder) -> None:
        if kind in ("step", "eval"):
            self.update(rec)


def save_dashboard(run_dir: Path | str, name: str = "dashboard.png") -> Path:
    """Re-plot a run folder's metrics as a PNG next to them (timeline: the last minute)."""
    return save_figure(load_metrics(run_dir), Path(run_dir) / name, figure=llm_figure,
                       window_s=60.0)


def compare_figure(runs: dict[str, MetricsRecorder]) -> Figure:
    """Reward and test accuracy against wall-clock time, one line per run (e.g. async/sync)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
    for label, rec in runs.items():
        plot_series(a, *series(rec.rows("step"), "reward", "wall_s"), label=label, smooth=10)
        evals = rec.rows("eval")
        t0 = rec.rows("step")[0]["t"] - rec.rows("step")[0]["wall_s"] if rec.rows("step") else 0
        plot_series(b, [r["t"] - t0 for r in evals], [r["accuracy"] for r in evals],
                    label=label, marker="o")
    for ax, what in ((a, "train reward"), (b, "test accuracy")):
        ax.set(title=f"{what} vs wall clock", xlabel="seconds of training", ylim=(0, 1))
        legend_if_any(ax)
    return fig


def record_run(run_dir: Path | str, dest: Path | str, *, busy_window_s: float = 30.0) -> Path:
    """Copy a run into ``dest`` small enough to ship (recent ``busy`` rows, 4-decimal floats)."""
    rows = load_metrics(run_dir).rows()
    busy_end = max((r["end"] for r in rows if r["kind"] == "busy"), default=0.0)
    with MetricsRecorder(dest) as out:
        for row in rows:
            if row["kind"] != "busy" or row["end"] >= busy_end - busy_window_s:
                out.log(**json.loads(json.dumps(row), parse_float=lambda s: round(float(s), 4)))
    for name in ("result.json", "config.json"):
        data = json.loads((Path(run_dir) / name).read_text())
        data.pop("run_dir", None)  # a path on the recording machine
        (Path(dest) / name).write_text(json.dumps(data, indent=1) + "\n")
    return Path(dest)


def recorded_run(folder: Path | str) -> tuple[Any, MetricsRecorder]:
    """``(RunResult, metrics)`` of a run folder, as ``train()`` returned them."""
    from grpo_nb.llm.summary import RunResult

    data = json.loads((Path(folder) / "result.json").read_text())
    known = {f.name for f in fields(RunResult)}
    result = RunResult(**{k: v for k, v in data.items() if k in known} | {"run_dir": str(folder)})
    return result, load_metrics(folder)
