"""A cost model of one GRPO step, checked against a run's own metric rows.

Per step the ring generates (G), trains (T) and syncs (S). In sync mode they alternate, so
a step costs G + T + S. In async mode generation overlaps training. A sync that pauses the
server (``pause_mode="keep"``, and on a GPU) puts S on both timelines; one without a pause
(``"none"``, the ring's default on CPU) leaves generation running while the trainer syncs::

    paused : server  ──generate (G)──┤ paused (S) ├──generate──…
             trainer ─wait─┤train (T)├ sync (S)   ├─wait─┤train…   step ≈ max(G, T) + S
    none   : server  ──generate (G)──┤load├──generate──…      (the engine stops only for the
             trainer ─wait─┤train (T)├ sync (S)├─wait─┤train…  update: S_server, part of S)
                                                step ≈ max(G + S_server, T + S)

``overlap_bound`` = (G + T + S) / max(G, T + S) is the most overlap gives when each phase
costs what it cost alone; ``model_speedup`` is the ring's model for its pause mode. A real
async server holds more requests at once, and batching makes each cheaper, so a measured
speed-up can exceed the bound by a little.

Only ``step``, ``sync``, ``eval`` and ``skipped`` rows are read, so a recorded run (whose
``busy`` rows are trimmed) gives the same numbers as the live one.
"""

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
    """Mean per-step times (seconds) over a run's steady steps.

    ``step`` is the measured time between consecutive step rows; in it the trainer waits for
    groups (``wait``), trains (``train``) and syncs (``sync``, 0 in a step without a sync), so
    ``wait = step − train − sync``. ``generate`` is timed by the generators' clock instead: from
    the first request of the step's groups until the trainer had them all (the largest group
    ``age_s`` minus ``train``). It is the generation time G only in sync mode, where a step's
    groups are requested after the previous sync; in async mode they were requested earlier
    and sat ready in a queue. ``server_sync`` is the part of ``sync`` the server's engine
    spent on the update itself (the gloo engine's start, receive, load and finish, or the
    reload RPC; 0 for runs that did not record sync phases)."""

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
    """Each steady step as (previous step row, its step row, the rows between them)."""
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
    """One dict per steady step: ``step``, ``train``, ``sync``, ``generate`` (seconds).

    Step k's interval runs from step k−1's row to step k's. Left out: step 1 (no sync before
    it, nothing to overlap yet) and any interval holding an eval, a skipped step or a
    checkpoint (after step k−1 when ``checkpoint_every`` divides k−1): none of them is part of
    the step being modelled."""
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

    def mean(key: str) -> float:
        return fmean(iv[key] for iv in ivs)

    step, train, sync = mean("step"), mean("train"), mean("sync")
    return StepPhases(steps=len(ivs), step=step, wait=step - train - sync, train=train,
                      sync=sync, generate=mean("generate"), server_sync=mean("server_sync"))


def predict(sync_run: StepPhases, *, paused: bool = True) -> Prediction:
    """Both modes' step times from the sync run's phases, where each is timed alone.

    G is the sync run's ``generate``; S its mean sync per step (with ``sync_every = k``,
    one step in k carries a sync, so S is already divided by k). ``paused``: whether a sync
    stops generation (every pause mode but ``"none"``); without a pause the engine still
    stops for the update itself (``S_server``, part of S)."""
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
    """The training loop's wall time: the first step's start to the last step's end
    (setup, the first sync and eval, and the end phase are outside it)."""
    steps = [r for r in rows if r["kind"] == "step"]
    if not steps:
        return 0.0
    return steps[-1]["t"] - (steps[0]["t"] - steps[0]["wall_s"])
