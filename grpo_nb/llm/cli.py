"""``python -m grpo_nb train``: a headless LLM GRPO run with a progress bar, a dashboard PNG,
and a JSON summary (:class:`~grpo_nb.llm.summary.RunResult`) as the last line of stdout."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from grpo_nb.config import smoke_mode
from grpo_nb.llm.config import LLMConfig
from grpo_nb.metrics import MetricsRecorder


def parse_config(argv: list[str]) -> tuple[argparse.Namespace, LLMConfig, bool]:
    """The command line's options, the config they describe, and whether smoke mode is on."""
    parser = argparse.ArgumentParser(
        prog="python -m grpo_nb train",
        description="Asynchronous (or synchronous) GRPO on the tiny Qwen3 model, served by vLLM.")
    parser.add_argument("--smoke", action="store_true", help="small CI preset (or GRPO_NB_SMOKE=1)")
    parser.add_argument("--mode", choices=["async", "sync"], help="default: async")
    parser.add_argument("--model", help="model folder (default: the tiny Qwen3, built if needed)")
    parser.add_argument("--resume", help="a run folder (runs/<name>) to continue from")
    parser.add_argument("--steps", type=int, help="total optimiser steps")
    parser.add_argument("--time-budget", type=float, help="seconds of training at most")
    parser.add_argument("--transport", choices=["gloo", "reload", "nccl", "ipc"],
                        help="weight sync: gloo/reload on CPU, nccl/ipc on GPU")
    parser.add_argument("--name", help="run folder name under runs/")
    args = parser.parse_args(argv)
    smoke = args.smoke or smoke_mode()
    cfg = LLMConfig.smoke() if smoke else LLMConfig()
    if args.resume:
        cfg = LLMConfig(**json.loads((Path(args.resume) / "config.json").read_text()))
    changes: dict[str, Any] = {}
    if args.mode:
        changes["mode"] = args.mode
    if args.steps:
        changes["steps"] = args.steps
    if args.time_budget:
        changes["time_budget_s"] = args.time_budget
    if args.transport:
        from grpo_nb.weight_sync import WeightSyncConfig

        changes["sync"] = WeightSyncConfig(**{**asdict(cfg.sync), "transport": args.transport})
    return args, cfg.replace(**changes), smoke


def cli(argv: list[str]) -> int:
    """Run, show progress on stderr, save the dashboard PNG, print the JSON summary last."""
    from tqdm.auto import tqdm

    from grpo_nb.llm.dashboard import save_dashboard
    from grpo_nb.llm.run import RunAborted, train

    args, cfg, smoke = parse_config(argv)
    bar = tqdm(total=cfg.steps, desc=f"GRPO {cfg.mode}", unit="step")

    def on_event(kind: str, rec: MetricsRecorder) -> None:
        if kind == "step":
            row = rec.rows("step")[-1]
            bar.n = row["step"]
            bar.set_postfix(reward=f"{row['reward']:.2f}", dropped=row.get("dropped", 0))
        elif kind == "eval":
            row = rec.rows("eval")[-1]
            bar.write(f"step {row['step']}: test accuracy {row['accuracy']:.3f}")

    try:
        result = asyncio.run(train(cfg, model_dir=args.model, name=args.name,
                                   resume=args.resume, on_event=on_event, smoke=smoke))
    except RunAborted as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    if result.run_dir:
        print(f"dashboard: {save_dashboard(result.run_dir)}", file=sys.stderr)
    print(json.dumps(asdict(result)))
    return 0
