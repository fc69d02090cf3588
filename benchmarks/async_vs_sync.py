"""Async vs sync GRPO on the tiny model: the training phase's wall time, and where it goes.

    tiny model (SFT warm start) ─► one vLLM server per partition setting (+ gloo engine)
        ├─ train(mode="async", steps=N) ─┐  per mode, from the run's metric rows:
        └─ train(mode="sync",  steps=N) ─┴► loop_s (first step's start → last step's end),
                                            per steady step (grpo_nb.llm.cost): wait (trainer
                                            idle = generation it could not hide), train, sync
    ─► one JSON line: both modes, ``speedup_async`` = sync loop_s / async loop_s, the
       overlap bound (G + T + S) / max(G, T + S), the paused-server model's
       (G + T + S) / (max(G, T) + S) and ``model_speedup`` (the model of the run's pause mode),
       from the sync run's phase times, and the median time of each sync phase.

``--partition on`` pins the server tree to its own core(s) and this process (controller and
trainer) to the others (:mod:`grpo_nb.partition`); ``off`` leaves both unpinned; ``both`` runs
the pair twice, one server after the other, so the partition's effect is measured. Run:
``.venv/bin/python benchmarks/async_vs_sync.py [--steps 30] [--partition both]
[--set prompts_per_step=32 --set sync.pause_mode=keep ...] [--repeats 3] [--backend monarch]``.
Overlap pays most when training costs what generation does: ``--set num_iterations=2`` (two
optimiser updates per batch) brings the default config's T/G from ≈ 0.4 to ≈ 0.7.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def phases(run_dir: str | Path) -> dict[str, Any]:
    """The training loop's wall time and its steady steps' phases (:mod:`grpo_nb.llm.cost`)."""
    from grpo_nb.llm.cost import loop_seconds, steady_sync_phases, step_phases
    from grpo_nb.metrics import load_metrics

    rows = load_metrics(run_dir).rows()
    steps = len([r for r in rows if r["kind"] == "step"])
    if steps < 3:
        return {"steps": steps}
    p = step_phases(rows)
    per = {"wait": p.wait, "train": p.train, "sync": p.sync, "generate": p.generate}
    sync_phases = {k: round(v, 1) for k, v in steady_sync_phases(rows).items()}
    return {"steps": steps, "loop_s": round(loop_seconds(rows), 2), "step_s": round(p.step, 3),
            "per_step_s": {k: round(v, 3) for k, v in per.items()},
            "sync_phases_ms": sync_phases, "cost": p}


def bound(sync_run: Any, paused: bool) -> dict[str, float]:
    """What overlap can give with the sync run's phases G, T, S (:func:`grpo_nb.llm.cost.predict`):
    ``overlap_bound`` = (G + T + S) / max(G, T + S); a sync that pauses the server makes the
    async step max(G, T) + S (``paused_bound``); ``model_speedup`` is the model of the run's
    own pause mode (without a pause: max(G + S_server, T + S))."""
    from grpo_nb.llm.cost import predict

    if sync_run is None:  # too few steps to model
        return {}
    pr = predict(sync_run, paused=paused)
    return {"G": round(pr.G, 3), "T": round(pr.T, 3), "S": round(pr.S, 3),
            "S_server": round(pr.S_server, 3),
            "predicted_sync_step_s": round(pr.sync_step, 3),
            "predicted_async_step_s": round(pr.async_step, 3),
            "overlap_bound": round(pr.overlap_bound, 2),
            "paused_bound": round(predict(sync_run).model_speedup, 2),
            "model_speedup": round(pr.model_speedup, 2)}


async def _pair(model_dir: str, base: Any, pin: bool, stamp: str,
                repeats: int = 1, backend: str = "asyncio") -> dict[str, Any]:
    """Both modes against one server, pinned (server tree + this process) or not.

    With ``repeats`` > 1 the pair runs again in alternating order (async→sync, sync→async, …)
    so a drift in the machine's speed hits both modes alike; ``speedup_async`` is then the
    median of the pairs' ratios and ``pairs`` lists each one."""
    from grpo_nb import partition
    from grpo_nb.llm.run import server_for, train

    plan = partition.plan() if pin else partition.plan(server_cpus="off")
    server = server_for(model_dir, base)
    server.cfg.cpus = list(plan.server_cpus) if plan.active else "off"
    await server.start_async()
    out: dict[str, Any] = {"plan": plan.describe(), "server_cpus": server.cpus}
    pairs: list[dict[str, Any]] = []
    try:
        with partition.pinned(plan):
            for r in range(repeats):
                runs: dict[str, Any] = {}
                costs: dict[str, Any] = {}  # per mode: grpo_nb.llm.cost.StepPhases
                for mode in ("async", "sync") if r % 2 == 0 else ("sync", "async"):
                    res = await train(base.replace(mode=mode), model_dir=model_dir,
                                      server=server, progress=False, backend=backend,
                                      name=f"bench-{mode}-{'pin' if pin else 'nopin'}-{stamp}-{r}")
                    measured = phases(res.run_dir)
                    costs[mode] = measured.pop("cost", None)
                    runs[mode] = {"wall_s": res.wall_s, "accuracy_after": res.accuracy_after,
                                  "staleness_mean": res.staleness_mean,
                                  "sync_ms_mean": res.sync_ms_mean, **measured}
                pairs.append({**runs, "bound": bound(costs["sync"],
                                                     base.sync.pause_mode != "none"),
                              "speedup_async": round(runs["sync"]["loop_s"]
                                                     / runs["async"]["loop_s"], 2),
                              "speedup_whole_run": round(runs["sync"]["wall_s"]
                                                         / runs["async"]["wall_s"], 2)})
    finally:
        await asyncio.to_thread(server.stop)
    first = pairs[0]
    for key in ("async", "sync", "bound"):
        out[key] = first[key]
    out["speedup_async"] = statistics.median(p["speedup_async"] for p in pairs)
    out["speedup_whole_run"] = statistics.median(p["speedup_whole_run"] for p in pairs)
    out["async_step_s_measured"] = first["async"]["step_s"]
    if repeats > 1:
        out["pairs"] = [{"speedup_async": p["speedup_async"],
                         "loop_s": [p["async"]["loop_s"], p["sync"]["loop_s"]],
                         "model_speedup": p["bound"].get("model_speedup"),
                         "G_T_S": [p["bound"].get(k) for k in ("G", "T", "S")]} for p in pairs]
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from grpo_nb.llm.cli import apply_sets
    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    model_dir = str(build_or_load(TinyModelConfig(), progress=False))
    base = apply_sets(LLMConfig(steps=args.steps, time_budget_s=None,
                                eval_every=max(args.steps, 1), eval_size=200,
                                checkpoint_every=10_000, seed=args.seed,
                                sync_every=args.sync_every), args.set).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out: dict[str, Any] = {"steps": args.steps, "sync_every": args.sync_every, "set": args.set,
                           "backend": args.backend,
                           "cpus": len(os.sched_getaffinity(0)),
                           "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    for pin in {"on": [True], "off": [False], "both": [False, True]}[args.partition]:
        out["partitioned" if pin else "unpartitioned"] = await _pair(model_dir, base, pin, stamp,
                                                                     args.repeats,
                                                                     args.backend)
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
    parser.add_argument("--repeats", type=int, default=1,
                        help="async/sync pairs on one server, in alternating order (median)")
    parser.add_argument("--backend", choices=("asyncio", "monarch"), default="asyncio",
                        help="monarch: the trainer (and each generator) in a process of its own")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="any LLMConfig field, as in `python -m grpo_nb train --set`")
    args = parser.parse_args(argv)
    out = asyncio.run(_run(args))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
