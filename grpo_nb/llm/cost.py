"""A cost model of one GRPO step (generate G, train T, sync S), checked against a run's own
metric rows: sync mode G + T + S; async max(G, T) + S, or max(G + S_server, T + S) when a sync
does not pause the server. ``busy`` rows are not read, so a recorded run gives the same numbers."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, median
from typing import Any

Row = Mapping[str, Any]
_KINDS = ("step", "sync", "eval", "skipped")  # the rows the model reads
SERVER_PHASES = ("start", "wait", "load", "finish")  # a sync's phases inside the engine


@dataclass(frozen=True)
class StepPhases:
    """Mean per-step seconds over a run's steady steps (``step`` = ``wait`` + ``train`` +
    ``sync``); ``generate``: first request to last group in (G in sync mode only)."""

    steps: int
    step: float
    wait: float
    train: float
    sync: float
    generate: float
    server_sync: float = 0.0


@dataclass(frozen=True)
class Prediction:
    """Step times (seconds) and speed-ups predicted from sync-mode phases G, T, S."""

    G: float
    T: float
    S: float
    S_server: float
    sync_step: float
    async_step: float
    overlap_bound: float
    model_speedup: float


def _steady(rows: Iterable[Row], checkpoint_every: int | None
            ) -> Iterator[tuple[Row, Row, list[Row]]]:
    """Each steady step (no eval, skip or checkpoint) as (previous row, its row, rows between)."""
    rows = sorted((r for r in rows if r["kind"] in _KINDS), key=lambda r: r["t"])
    steps = [r for r in rows if r["kind"] == "step"]
    for prev, cur in zip(steps, steps[1:], strict=False):
        inside = [r for r in rows if prev["t"] < r["t"] <= cur["t"]]
        if any(r["kind"] in ("eval", "skipped") for r in inside):
            continue
        if checkpoint_every and prev["step"] % checkpoint_every == 0:
            continue
        yield prev, cur, inside


def steady_intervals(rows: Iterable[Row], checkpoint_every: int | None = None
                     ) -> list[dict[str, float]]:
    """One dict of seconds per steady step (``step``, ``train``, ``sync``, ``generate`` …)."""
    out: list[dict[str, float]] = []
    for prev, cur, inside in _steady(rows, checkpoint_every):
        syncs = [r for r in inside if r["kind"] == "sync"]
        server = sum(r.get("phases", {}).get(k, 0.0) for r in syncs for k in SERVER_PHASES)
        train = float(cur["train_s"])
        out.append({"step": cur["t"] - prev["t"], "train": train,
                    "sync": sum(r["ms"] for r in syncs) / 1000.0, "server_sync": server / 1000.0,
                    "generate": max(cur["age_s"]) - train})
    return out


def steady_sync_phases(rows: Iterable[Row], checkpoint_every: int | None = None
                       ) -> dict[str, float]:
    """Median ms of each sync phase over the syncs inside :func:`steady_intervals`' steps."""
    syncs = [r["phases"] for _, _, inside in _steady(rows, checkpoint_every)
             for r in inside if r["kind"] == "sync" and r.get("phases")]
    names = sorted({k for ph in syncs for k in ph})
    return {k: median(ph.get(k, 0.0) for ph in syncs) for k in names}


def step_phases(rows: Iterable[Row], checkpoint_every: int | None = None) -> StepPhases:
    """The mean of :func:`steady_intervals` (``ValueError`` when a run has none)."""
    ivs = steady_intervals(rows, checkpoint_every)
    if not ivs:
        raise ValueError("no steady step in these rows: a run needs at least 2 steps outside "
                         "evals and checkpoints")
    mean = {k: fmean(iv[k] for iv in ivs) for k in ivs[0]}
    return StepPhases(steps=len(ivs), wait=mean["step"] - mean["train"] - mean["sync"], **mean)


def predict(sync_run: StepPhases, *, paused: bool = True) -> Prediction:
    """Both modes' step times from the sync run's phases; ``paused``: a sync stops generation
    (every pause mode but ``"none"``). ``overlap_bound`` = (G + T + S) / max(G, T + S)."""
    g, t, s, s_server = sync_run.generate, sync_run.train, sync_run.sync, sync_run.server_sync
    sync_step = g + t + s
    async_step = max(g, t) + s if paused else max(g + s_server, t + s)
    return Prediction(G=g, T=t, S=s, S_server=s_server, sync_step=sync_step,
                      async_step=async_step,
                      overlap_bound=sync_step / max(g, t + s),
                      model_speedup=sync_step / async_step)


def run_pause_mode(run_dir: str | Path) -> str:
    """The pause mode a run's syncs used (its ``config.json``; ``"keep"`` if it names none)."""
    config = json.loads((Path(run_dir) / "config.json").read_text())
    return str(config.get("sync", {}).get("pause_mode", "keep"))


def loop_seconds(rows: Iterable[Row]) -> float:
    """The training loop's wall time, the first step's start to the last step's end."""
    steps = [r for r in rows if r["kind"] == "step"]
    return steps[-1]["t"] - (steps[0]["t"] - steps[0]["wall_s"]) if steps else 0.0
