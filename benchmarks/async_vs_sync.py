"""Async vs sync GRPO on the tiny model: the training phase's wall time, and where it goes.

    tiny model (SFT warm start) ─► one vLLM server per partition setting (+ gloo engine)
        ├─ train(mode="async", steps=N) ─┐  per mode, from the run's metric rows:
        └─ train(mode="sync",  steps=N) ─┴► loop_s (first step's start → last step's end),
                                            per step: wait (trainer idle = generation it
                                            could not hide), train, sync, gen_busy
    ─► one JSON line: both modes, ``speedup_async`` = sync loop_s / async loop_s, and the
       overlap bound (G + T + S) / max(G, T + S) from the sync run's phase times.

``--partition on`` pins the server tree to its own core(s) and this process (controller and
trainer) to the others (:mod:`grpo_nb.partition`); ``off`` leaves both unpinned; ``both`` runs
the pair twice, one server after the other, so the partition's effect is measured. Run:
``.venv/bin/python benchmarks/async_vs_sync.py [--steps 30] [--partition both]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any


def _union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length covered by ``intervals`` inside ``[lo, hi]``."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total, end = total + b - a, b
    return total


def phases(run_dir: str | Path) -> dict[str, Any]:
    """Per-step phase times of the training loop, from ``metrics.jsonl``.

    The loop runs from the first step's start to the last step's end (setup, first sync and
    eval, and the end phase are excluded). In it the trainer is busy training, syncing or
    evaluating, and otherwise waits for groups: that wait is the generation time it could
    not overlap (in sync mode, all of it)."""
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    if not steps:
        return {"steps": 0}
    lo = steps[0]["t"] - steps[0]["wall_s"]  # the loop's t0 on the recorder's clock
    hi = steps[-1]["t"]
    busy = [r for r in rows if r["kind"] == "busy"]
    trainer = {label: _union([(r["start"], r["end"]) for r in busy
                              if r["actor"] == "trainer" and r["label"] == label], lo, hi)
               for label in ("train", "sync", "eval")}
    gen = _union([(r["start"], r["end"]) for r in busy if r["label"] == "generate"], lo, hi)
    n, loop = len(steps), hi - lo
    per = {"wait": (loop - sum(trainer.values())) / n, "train": trainer["train"] / n,
           "sync": trainer["sync"] / n, "eval": trainer["eval"] / n, "gen_busy": gen / n}
    return {"steps": n, "loop_s": round(loop, 2), "step_s": round(loop / n, 3),
            "per_step_s": {k: round(v, 3) for k, v in per.items()}}


def bound(sync_phases: dict[str, Any], sync_every: int = 1) -> dict[str, float]:
    """What overlap can give with the sync run's phase times G, T, S (per step).

    ``overlap_bound`` = (G + T + S) / max(G, T + S): generation hidden behind training and
    syncing. But a sync pauses the server, so generation cannot run during it either: the
    cost model's async step is max(G, T) + S/sync_every, and ``paused_bound`` is what
    remains."""
    p = sync_phases["per_step_s"]
    g, t, s = p["wait"], p["train"], p["sync"]
    s_async = s / sync_every
    paused = max(g, t) + s_async

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b > 0 else 1.0

    return {"G": g, "T": t, "S": s, "predicted_sync_step_s": round(g + t + s, 3),
            "predicted_async_step_s": round(paused, 3),
            "overlap_bound": ratio(g + t + s, max(g, t + s)),
            "paused_bound": ratio(g + t + s, paused)}


async def _pair(model_dir: str, base: Any, pin: bool, stamp: str) -> dict[str, Any]:
    """Both modes against one server, pinned (server tree + this process) or not."""
    from grpo_nb import partition
    from grpo_nb.llm.run import server_for, train

    plan = partition.plan() if pin else partition.plan(server_cpus="off")
    server = server_for(model_dir, base)
    server.cfg.cpus = list(plan.server_cpus) if plan.active else "off"
    await server.start_async()
    out: dict[str, Any] = {"plan": plan.describe(), "server_cpus": server.cpus}
    try:
        with partition.pinned(plan):
            for mode in ("async", "sync"):
                res = await train(base.replace(mode=mode), model_dir=model_dir, server=server,
                                  name=f"bench-{mode}-{'pin' if pin else 'nopin'}-{stamp}",
                                  progress=False)
                out[mode] = {"wall_s": res.wall_s, "accuracy_after": res.accuracy_after,
                             "staleness_mean": res.staleness_mean,
                             "sync_ms_mean": res.sync_ms_mean, **phases(res.run_dir)}
    finally:
        await asyncio.to_thread(server.stop)
    out["speedup_async"] = round(out["sync"]["loop_s"] / out["async"]["loop_s"], 2)
    out["speedup_whole_run"] = round(out["sync"]["wall_s"] / out["async"]["wall_s"], 2)
    out["bound"] = bound(out["sync"], base.sync_every)
    out["async_step_s_measured"] = out["async"]["step_s"]
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    model_dir = str(build_or_load(TinyModelConfig(), progress=False))
    base = LLMConfig(steps=args.steps, time_budget_s=None, eval_every=max(args.steps, 1),
                     eval_size=200, checkpoint_every=10_000, seed=args.seed,
                     sync_every=args.sync_every)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out: dict[str, Any] = {"steps": args.steps, "sync_every": args.sync_every,
                           "cpus": len(os.sched_getaffinity(0)),
                           "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    for pin in {"on": [True], "off": [False], "both": [False, True]}[args.partition]:
        out["partitioned" if pin else "unpartitioned"] = await _pair(model_dir, base, pin, stamp)
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    main = out.get("partitioned") or out["unpartitioned"]
    out["speedup_async"] = main["speedup_async"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sync-every", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partition", choices=("on", "off", "both"), default="on")
    args = parser.parse_args(argv)
    out = asyncio.run(_run(args))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
