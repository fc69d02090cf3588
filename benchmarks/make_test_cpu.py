"""Where a command's CPU time goes: run it (by default ``bash .ci/run``, i.e. ``make test``),
sample every process on the machine once a second from ``/proc``, and print one JSON line.

    python benchmarks/make_test_cpu.py                      # make test, as CI runs it
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/make_test_cpu.py   # cold compile cache
    python benchmarks/make_test_cpu.py -- make pytest-cpu   # any other command

The JSON holds the wall time, the machine's busy CPU seconds (``/proc/stat``) against the
seconds its cores had, the busy share per 30 s window, the CPU seconds of the command's own
process tree, how many vLLM servers started, and the CPU seconds of every process seen during
the run, summed by kind: a vLLM server's whole tree (API server, engine, workers), pytest
processes, Jupyter kernels, ``grpo_nb train`` CLIs, Chromium, compilers, installers. A process
is counted once, by what its own ``/proc/PID/stat`` says (its children are counted apart), so
processes nobody waits for (a killed server's engine) are counted too, which ``time`` misses.
Processes shorter than the sampling interval may be missed: the kinds are a floor.
Other processes on the machine are counted too: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

HZ = os.sysconf("SC_CLK_TCK")
VLLM_SERVER = "vllm.entrypoints.openai.api_server"


@dataclass
class Proc:
    """One process as sampled: its parent when first seen, its latest command line, its CPU."""

    pid: int
    ppid: int
    cmd: str
    cpu_s: float = 0.0  # CPU seconds since the first sample (the run's, not the process's life)
    base_s: float = 0.0  # what it had used when first seen in the sample before the run
    before: bool = False  # seen in the sample before the run: it did not start during it
    first: float = field(default_factory=time.time)


def read_proc(pid: str) -> tuple[int, int, float, str] | None:
    """``(ppid, starttime, cpu_s, cmdline)`` of one process, or ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()  # the name in () may hold spaces
    cpu = (int(rest[11]) + int(rest[12])) / HZ  # utime + stime, this process alone
    return int(rest[1]), int(rest[19]), cpu, cmd[:400]


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot: total less idle and iowait."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def sample(seen: dict[tuple[int, int], Proc], *, before_the_run: bool = False) -> None:
    """Update every process's CPU seconds; ``before_the_run``: what each has used so far is a
    baseline, not counted (a process first seen later started after the run began)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        got = read_proc(pid)
        if got is None:
            continue
        ppid, start, cpu, cmd = got
        proc = seen.setdefault((int(pid), start),
                               Proc(int(pid), ppid, cmd, base_s=cpu if before_the_run else 0.0,
                                    before=before_the_run))
        proc.cpu_s = cpu - proc.base_s
        proc.cmd = cmd or proc.cmd  # a process that sets its title (VLLM::EngineCore) keeps it


def kind(proc: Proc, by_pid: dict[int, Proc]) -> str:
    """What a process is part of: the first vLLM server among itself and its ancestors (by the
    parent each had when first seen), else what its own command line says."""
    node: Proc | None = proc
    for _ in range(64):  # ancestors, bounded: pids are reused
        if node is None:
            break
        if VLLM_SERVER in node.cmd or node.cmd.startswith("VLLM::"):
            return "vllm servers"
        node = by_pid.get(node.ppid)
    cmd = proc.cmd
    for name, marks in (("pytest", ("pytest",)), ("jupyter kernels", ("ipykernel",)),
                        ("grpo_nb train CLIs", ("-m grpo_nb train",)),
                        ("installers", ("uv pip", "-m pip", "apt-get", "dpkg")),
                        ("chromium", ("chrom",)),
                        ("compilers", ("cc1", "g++", "gcc", "collect2", "/usr/bin/ld"))):
        if any(mark in cmd for mark in marks):
            return name
    return "other"


def descends_from(proc: Proc, root: int, by_pid: dict[int, Proc]) -> bool:
    node: Proc | None = proc
    for _ in range(64):
        if node is None:
            return False
        if node.pid == root:
            return True
        node = by_pid.get(node.ppid)
    return False


def summarise(seen: list[Proc], busy: list[tuple[float, int, int]], wall_s: float,
              rc: int, cmd: list[str], root: int) -> dict:
    by_pid = {p.pid: p for p in sorted(seen, key=lambda p: p.first)}
    kinds: Counter[str] = Counter()
    for proc in seen:
        kinds[kind(proc, by_pid)] += proc.cpu_s
    own = sum(p.cpu_s for p in seen if descends_from(p, root, by_pid))
    servers = sum(1 for p in seen if VLLM_SERVER in p.cmd and not p.before)
    windows = []
    for i in range(0, len(busy) - 1, 30):
        (_, b0, t0), (_, b1, t1) = busy[i], busy[min(i + 30, len(busy) - 1)]
        windows.append(round((b1 - b0) / max(t1 - t0, 1), 2))
    (_, b_first, t_first), (_, b_last, t_last) = busy[0], busy[-1]
    return {"cmd": " ".join(cmd), "rc": rc, "wall_s": round(wall_s, 1),
            "busy_cpu_s": round((b_last - b_first) / HZ, 1),
            "machine_cpu_s": round((t_last - t_first) / HZ, 1),
            "busy_frac": round((b_last - b_first) / max(t_last - t_first, 1), 3),
            "busy_frac_per_30s": windows, "command_tree_cpu_s": round(own, 1),
            "vllm_server_starts": servers,
            "cpu_s_by_kind": {k: round(v, 1) for k, v in kinds.most_common()},
            "processes_seen": len(seen)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("cmd", nargs="*", help="the command (after --); default: bash .ci/run")
    args = ap.parse_args(argv)
    cmd = args.cmd or ["bash", ".ci/run"]
    seen: dict[tuple[int, int], Proc] = {}
    sample(seen, before_the_run=True)
    busy = [(time.time(), *busy_jiffies())]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=2)  # its output on our stderr: visible, off the JSON
    try:
        while proc.poll() is None:
            sample(seen)
            busy.append((time.time(), *busy_jiffies()))
            time.sleep(args.interval)
    finally:
        if proc.poll() is None:
            proc.terminate()
        rc = proc.wait()
    sample(seen)
    busy.append((time.time(), *busy_jiffies()))
    print(json.dumps(summarise(list(seen.values()), busy, time.monotonic() - t0, rc, cmd,
                               proc.pid)))
    return rc


if __name__ == "__main__":
    sys.exit(main())
