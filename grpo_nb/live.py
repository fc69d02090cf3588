"""Figures of a ring run from its metric rows: redrawn live, saved as PNG, or re-plotted from
``metrics.jsonl``; the panel helpers (an ``Axes`` and rows) serve the LLM dashboard too.
"""

from __future__ import annotations

import io
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from grpo_nb.metrics import MetricsRecorder, load_metrics

Rows = Sequence[dict[str, Any]]

# One colour per phase in every figure and refresh: a colour assigned by position among the
# labels present would change as phases enter and leave the plotted window.
PHASE_COLORS: dict[str, str] = {"generate": "tab:orange", "score": "tab:green",
                                 "ref logp": "tab:olive", "pass through": "tab:gray",
                                 "train": "tab:purple", "sync": "tab:red", "eval": "tab:blue"}
_SPARE_COLORS = ("tab:brown", "tab:pink", "tab:cyan", "black")  # unknown labels, by hash
_LANES = ("gen", "scorer", "ref", "trainer")  # timeline lanes, top to bottom, by name prefix


def legend_if_any(ax: Axes, **kwargs: Any) -> None:
    """``ax.legend(**kwargs)`` only when something has a label (else matplotlib warns)."""
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(**kwargs)


def series(rows: Rows, key: str, x: str = "t") -> tuple[list, list]:
    """``(xs, ys)`` of the rows that have a value for ``key``."""
    pts = [(r[x], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_series(ax: Axes, xs: Sequence[float], ys: Sequence[float], *, label: str = "",
                smooth: int = 1, **kwargs: Any) -> None:
    """A line (none for no points), optionally under a trailing moving average of ``smooth``."""
    if not len(xs):
        return
    ys_f = [float("nan") if y is None else float(y) for y in ys]
    if smooth > 1 and len(ys_f) >= 2:
        ax.plot(xs, ys_f, alpha=0.25, **kwargs)
        ys_f = [fmean(ys_f[max(0, i - smooth + 1): i + 1]) for i in range(len(ys_f))]
    ax.plot(xs, ys_f, label=label, **kwargs)


def plot_staleness(ax: Axes, values: Iterable[int], *, title: str = "staleness of consumed samples") -> None:
    """Histogram of staleness (trainer version minus the generating policy's version)."""
    vals = [int(v) for v in values]
    if vals:
        hi = max(vals)
        ax.hist(vals, bins=[b - 0.5 for b in range(hi + 2)], color="tab:purple", rwidth=0.85)
        mean = sum(vals) / len(vals)
        ax.axvline(mean, color="k", ls="--", lw=1, label=f"mean {mean:.2f}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set(title=title, xlabel="versions behind", ylabel="samples")


def plot_timeline(ax: Axes, busy_rows: Rows, *, window_s: float | None = None,
                  title: str = "who was busy when") -> None:
    """Gantt chart of ``busy`` rows, one lane per actor; ``window_s``: only the last seconds."""
    rows = list(busy_rows)
    if window_s is not None and rows:
        t_end = max(r["end"] for r in rows)
        rows = [r for r in rows if r["end"] >= t_end - window_s]
    actors = sorted({r["actor"] for r in rows},
                    key=lambda a: (next((i for i, p in enumerate(_LANES) if a.startswith(p)), 9), a))
    order = list(PHASE_COLORS)
    labels = sorted({r.get("label", "") for r in rows},
                    key=lambda lab: (order.index(lab) if lab in order else len(order), lab))
    colors = {lab: PHASE_COLORS.get(lab) or _SPARE_COLORS[zlib.crc32(lab.encode()) % len(_SPARE_COLORS)]
              for lab in labels}
    for lane, actor in enumerate(actors):
        for lab in labels:
            spans = [(r["start"], max(r["end"] - r["start"], 1e-4)) for r in rows
                     if r["actor"] == actor and r.get("label", "") == lab]
            if spans:
                ax.broken_barh(spans, (lane - 0.4, 0.8), color=colors[lab])
    ax.set_yticks(range(len(actors)), actors)
    ax.set_ylim(-0.6, max(len(actors), 1) + 0.5)  # headroom for the legend
    if rows:  # collections do not take part in autoscaling after a redraw: set x explicitly
        t0, t1 = min(r["start"] for r in rows), max(r["end"] for r in rows)
        ax.set_xlim(t0, t1 + 1e-3)
    ax.set(title=title, xlabel="time (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[lab]) for lab in labels]
    if handles:
        ax.legend(handles, labels, loc="upper left", fontsize=7, ncols=min(4, len(labels)))


def toy_figure(rec: MetricsRecorder, *, optimum: float = 1.0, random_reward: float | None = None,
               fig: Figure | None = None, window_s: float | None = 3.0) -> Figure:
    """The toy ring's 2x2 figure: reward, KL and entropy, staleness, actor timeline."""
    if fig is None:
        fig = plt.figure(figsize=(11, 6.5))
    fig.clear()
    (ax_r, ax_kl), (ax_st, ax_tl) = fig.subplots(2, 2)
    # Fixed margins: a layout engine costs more than the drawing itself.
    fig.subplots_adjust(left=0.06, right=0.98, top=0.95, bottom=0.08, hspace=0.42, wspace=0.22)
    steps = rec.rows("step")
    plot_series(ax_r, *series(steps, "reward", "step"), label="sampled reward", smooth=10,
                color="tab:blue")
    plot_series(ax_r, *series(steps, "expected_reward", "step"), label="policy's expected reward",
                color="tab:green")
    ax_r.axhline(optimum, color="tab:red", ls="--", lw=1, label=f"optimum {optimum:g}")
    if random_reward is not None:
        ax_r.axhline(random_reward, color="grey", ls=":", lw=1, label=f"random {random_reward:.2f}")
    # all-equal rewards: zero advantages, no gradient (solved, or stuck)
    plot_series(ax_r, *series(steps, "zero_std_frac", "step"), label="groups with no signal",
                smooth=10, color="tab:gray", ls="--")
    ax_r.set(title="reward", xlabel="trainer step")
    legend_if_any(ax_r, loc="lower right", fontsize=8)
    plot_series(ax_kl, *series(steps, "kl", "step"), label="KL to reference", color="tab:orange")
    # near 0: the policy stopped exploring
    plot_series(ax_kl, *series(steps, "entropy", "step"), label="policy entropy",
                color="tab:purple")
    legend_if_any(ax_kl, loc="upper right", fontsize=8)
    ax_r.set_ylim(-0.02, 1.05 * optimum)
    ax_kl.set(title="KL(policy ‖ reference) and entropy (nats)", xlabel="trainer step")
    plot_staleness(ax_st, [s for r in steps for s in r.get("staleness", [])])
    plot_timeline(ax_tl, rec.rows("busy"), window_s=window_s,
                  title="who was busy when" + (f" (last {window_s:g} s)" if window_s else ""))
    return fig


class LivePlot:
    """A figure redrawn in place while a ring runs: ``update(rec)`` after each step, ``close(rec)``
    for the final frame; redraws are spaced, since drawing stops the actors' event loop."""

    def __init__(self, figure: Callable[..., Figure] = toy_figure, *, every_s: float = 0.3,
                 dpi: int = 72, **figure_kw: Any) -> None:
        from IPython.display import display

        self.figure, self.figure_kw = figure, figure_kw
        self.every_s, self.dpi = every_s, dpi
        self.fig = figure(MetricsRecorder(None), **figure_kw)  # at the figure's own size
        plt.close(self.fig)  # shown through the handle only, not again at the cell's end
        self.frames, self.draw_s, self._last = 0, 0.0, 0.0
        self.handle = display(self._render(MetricsRecorder(None)), display_id=True)

    def _render(self, rec: MetricsRecorder) -> Any:
        from IPython.display import Image

        t0 = time.perf_counter()
        self.figure(rec, fig=self.fig, **self.figure_kw)
        buf = io.BytesIO()
        self.fig.savefig(buf, format="png", dpi=self.dpi)
        self.draw_s = time.perf_counter() - t0
        return Image(data=buf.getvalue(), format="png")

    def update(self, rec: MetricsRecorder, *, force: bool = False) -> None:
        if not force and time.perf_counter() - self._last < max(self.every_s, 3 * self.draw_s):
            return
        image = self._render(rec)
        self._last = time.perf_counter()
        if self.handle is not None:
            self.handle.update(image)
        self.frames += 1

    def close(self, rec: MetricsRecorder) -> None:
        """Draw the final frame (the one the saved notebook keeps)."""
        self.update(rec, force=True)


class StepBar:
    """The commands' tqdm bar of trainer steps on stderr, made at its first use (bad input shows
    none): :meth:`step` moves it to a step row and shows its ``shown`` fields (name: format)."""

    def __init__(self, total: int, desc: str, **shown: str) -> None:
        self.total, self.desc, self.shown, self.bar = total, desc, shown, None

    def write(self, text: str = "") -> Any:
        from tqdm.auto import tqdm

        if self.bar is None:
            self.bar = tqdm(total=self.total, desc=self.desc, unit="step", file=sys.stderr)
        if text:
            self.bar.write(text)
        return self.bar

    def step(self, row: dict[str, Any]) -> None:
        bar = self.write()
        bar.set_postfix({k: format(row.get(k, 0), f) for k, f in self.shown.items()},
                        refresh=False)
        bar.update(row["step"] - bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def save_figure(rec: MetricsRecorder, path: Path | str, *,
                figure: Callable[..., Figure] = toy_figure, **kwargs: Any) -> Path:
    """Write ``figure(rec)`` (the toy ring's, by default) to ``path`` as PNG; returns the path."""
    fig = figure(rec, **{"window_s": None, **kwargs})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def load_run(run_dir: Path | str, *, figure: Callable[..., Figure] = toy_figure,
             **kwargs: Any) -> Figure:
    """Re-plot a run from its ``metrics.jsonl`` (``figure=llm_figure`` for an LLM run)."""
    return figure(load_metrics(run_dir), **{"window_s": None, **kwargs})
