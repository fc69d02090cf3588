"""What a first GPU run must show (``gpu_check.py``'s full check), read from the run's metric
rows (``runs/<name>/metrics.jsonl``), and the peak memory of its two processes.

    agreement   ``tis_weight_mean``, ``tis_capped_frac``: under bf16 with
                ``ratio_against="trainer"`` the ratio is 1 and the clip never acts, so the
                truncated importance weight π_trainer / π_vLLM is the only measure of how far
                the trainer and vLLM disagree on the same tokens
    changes     ``step_changed_frac`` (the trainer's parameters an update changed) and
                ``sent_changed_frac`` (those still changed in the dtype a sync sends)
    throughput  generated tokens per second of the steady steps: every step after the first,
                from the first step's row to the last's, less the trainer's evaluation and
                checkpoint time in between; not trained tokens over a wall time that holds
                start-up, evaluation and checkpoints
    phases      seconds per trainer phase, the generators' busy time, the trainer's wait for
                groups, each sync phase's mean
    memory      :class:`MemorySampler`: resident and GPU memory of the server's process tree
                and of the trainer's process, sampled while the run goes

Only the standard library: ``gpu_check.py`` is imported where no more than torch and
transformers are installed (tests/test_gpu_check.py).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def _mean(values: Iterable[Any]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return round(statistics.fmean(xs), 4) if xs else None


def _union_s(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``spans`` (intervals may overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _within(row: Row, t0: float, t1: float) -> float:
    return max(0.0, min(row["end"], t1) - max(row["start"], t0))


def agreement(steps: list[Row]) -> Row:
    """Trainer-vs-vLLM agreement per step, averaged: the loss returns ``tis_frac_capped``, a
    step row may carry it as ``tis_capped_frac``; either is read."""
    capped = [r.get("tis_capped_frac", r.get("tis_frac_capped")) for r in steps]
    weights = [r["tis_weight_mean"] for r in steps if r.get("tis_weight_mean") is not None]
    return {"tis_weight_mean": _mean(weights),
            "tis_weight_range": [round(min(weights), 4), round(max(weights), 4)]
            if weights else None,
            "tis_capped_frac": _mean(capped)}


def throughput(steps: list[Row], busy: list[Row]) -> Row:
    """Generated tokens (the completions each step trained on) per second of the steady steps."""
    steady = steps[1:]
    if not steady:
        return {"gen_tokens_per_s": None, "steady_steps": 0,
                "why": "one step or none: no steady step to time"}
    t0, t1 = steps[0]["t"], steps[-1]["t"]
    paused = sum(_within(r, t0, t1) for r in busy
                 if r.get("actor") == "trainer" and r.get("label") in ("eval", "checkpoint"))
    span = t1 - t0 - paused
    tokens = sum(int(r.get("tokens", 0)) for r in steady)
    return {"gen_tokens_per_s": round(tokens / span, 1) if span > 0 else None,
            "steady_steps": len(steady), "steady_s": round(span, 3), "steady_tokens": tokens,
            "paused_s": round(paused, 3)}


def phases(steps: list[Row], syncs: list[Row], busy: list[Row]) -> Row:
    """Where the time went: the trainer's busy seconds per phase (whole run), the generators'
    busy time (at least one request in flight), and, over the steady steps, the trainer's wait
    for groups; a step's training time and each sync phase, as means."""
    trainer: dict[str, float] = {}
    for r in busy:
        if r.get("actor") == "trainer":
            trainer[r["label"]] = trainer.get(r["label"], 0.0) + r["end"] - r["start"]
    generating = _union_s((r["start"], r["end"]) for r in busy if r.get("label") == "generate")
    out: Row = {"trainer_s": {k: round(v, 3) for k, v in sorted(trainer.items())},
                "generators_busy_s": round(generating, 3),
                "step_train_s_mean": _mean(r.get("train_s") for r in steps[1:] or steps),
                "sync_ms_mean": _mean(r.get("ms") for r in syncs)}
    if len(steps) > 1:
        t0, t1 = steps[0]["t"], steps[-1]["t"]
        working = sum(_within(r, t0, t1) for r in busy if r.get("actor") == "trainer")
        out["trainer_wait_s"] = round(max(0.0, t1 - t0 - working), 3)
    names = sorted({k for r in syncs for k in r.get("phases", {})})
    out["sync_phases_ms_mean"] = {k: _mean(r.get("phases", {}).get(k) for r in syncs)
                                  for k in names}
    return out


def figures(rows: list[Row]) -> Row:
    """The report's figures from a run's metric rows (``MetricsRecorder.rows()``)."""
    steps = [r for r in rows if r.get("kind") == "step"]
    syncs = [r for r in rows if r.get("kind") == "sync"]
    busy = [r for r in rows if r.get("kind") == "busy"]
    return {**agreement(steps),
            "step_changed_frac": _mean(r.get("step_changed_frac") for r in steps),
            "sent_changed_frac": _mean(r.get("sent_changed_frac") for r in steps),
            "truncated_frac": _mean(r.get("truncated_frac") for r in steps),
            "throughput": throughput(steps, busy), "phases": phases(steps, syncs, busy)}


# ── memory of both processes, sampled ──


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (Linux ``/proc``)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    return tree


def peak_rss_gib(pid: int) -> float:
    """A process's own peak resident set (``VmHWM``), in GiB; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def gpu_memory_by_pid() -> dict[int, float] | str:
    """GiB of GPU memory each process holds now (``nvidia-smi``), or why it cannot be read."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"nvidia-smi failed: {err}"
    used: dict[int, float] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0.0) + int(mib) / 1024
    return used


class MemorySampler:
    """Peak memory of the server's process tree and the trainer's processes, sampled every
    ``every_s`` on a thread while the run goes: per process the peak resident set (``VmHWM``,
    summed over a tree: its processes may peak at different moments, so an upper bound) and
    GPU memory as ``nvidia-smi`` sees it (vLLM holds its share from start-up, so a sample is
    near its peak). A process ``nvidia-smi`` does not list (another PID namespace) reads 0."""

    def __init__(self, server_pid: int | None, trainer_pids: Iterable[int] | None = None,
                 every_s: float = 1.0) -> None:
        """``trainer_pids``: None for this process; more join as they are known."""
        self.server_pid, self.every_s = server_pid, every_s
        self.trainer_pids = {os.getpid()} if trainer_pids is None else set(trainer_pids)
        self.server: set[int] = set()
        self.rss: dict[int, float] = {}
        self.gpu = {"server": 0.0, "trainer": 0.0}
        self.gpu_problem: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="memory-sampler")

    def sample(self) -> None:
        """One reading (``trainer_pids`` may grow from another thread: read as a copy)."""
        if self.server_pid is not None:
            self.server |= set(process_tree(self.server_pid))
        trainer = set(self.trainer_pids)
        for pid in self.server | trainer:
            self.rss[pid] = max(self.rss.get(pid, 0.0), peak_rss_gib(pid))
        used = gpu_memory_by_pid()
        if isinstance(used, str):
            self.gpu_problem = used
            return
        for side, pids in (("server", self.server), ("trainer", trainer)):
            self.gpu[side] = max(self.gpu[side], sum(used.get(p, 0.0) for p in pids))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.every_s + 15)
        self.sample()

    def report(self, trainer_torch: Row | None = None) -> Row:
        """Both sides' peaks in GiB; ``trainer_torch``: the trainer's own allocator peaks."""
        def side(pids: set[int], gpu: float) -> Row:
            return {"pids": sorted(pids), "peak_rss_gib": round(sum(
                self.rss.get(p, 0.0) for p in pids), 2),
                    "peak_gpu_gib": self.gpu_problem or round(gpu, 2)}

        return {"server": side(self.server, self.gpu["server"]),
                "trainer": {**side(self.trainer_pids, self.gpu["trainer"]),
                            **(trainer_torch or {})}}
