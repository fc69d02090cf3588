"""``python -m grpo_nb train``: a headless LLM GRPO run (progress bar, dashboard PNG, JSON
summary last); ``--set FIELD=VALUE`` takes any LLMConfig field, read by the field's type."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pydantic

from grpo_nb.config import preset, smoke_mode
from grpo_nb.llm.config import LLMConfig
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.weight_sync import WeightSyncConfig


def _convert(cls: type, name: str, raw: str) -> Any:
    """``raw`` read as ``cls``'s field ``name`` by its annotation (JSON first, then pydantic's
    lax rules for text: ``yes``, ``1e-5``); errors name the field."""
    hints = typing.get_type_hints(cls)
    if name not in hints:
        raise ValueError(f"--set {name}=…: {cls.__name__} has no field {name!r} (fields: "
                         f"{', '.join(f.name for f in fields(cls))})")
    hint, value = hints[name], None if raw.strip().lower() in ("none", "null") else raw
    if hint is Any:  # the config validates it
        return raw
    adapter = pydantic.TypeAdapter(hint)
    with contextlib.suppress(pydantic.ValidationError):
        return adapter.validate_json(raw)
    try:
        return adapter.validate_python(value)
    except pydantic.ValidationError:
        shown = getattr(hint, "__name__", str(hint))
        raise ValueError(f"--set {name}={raw!r}: {cls.__name__}.{name} expects {shown}") from None


def apply_sets(cfg: LLMConfig, assignments: list[str]) -> LLMConfig:
    """``cfg`` with ``FIELD=VALUE`` (or ``sync.FIELD=VALUE``) assignments, validated."""
    changes: dict[str, Any] = {}
    sync: dict[str, Any] = {}
    for item in assignments:
        name, eq, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not eq or not name:
            raise ValueError(f"--set {item!r}: write FIELD=VALUE")
        if name.startswith("sync."):
            sync[name[5:]] = _convert(WeightSyncConfig, name[5:], raw)
        elif name == "sync":
            raise ValueError("--set sync=…: set its fields, e.g. --set sync.transport=reload")
        else:
            changes[name] = _convert(LLMConfig, name, raw)
    if sync:
        changes["sync"] = WeightSyncConfig(**{**asdict(cfg.sync), **sync})
    return cfg.replace(**changes)


def parse_config(argv: list[str]) -> tuple[argparse.Namespace, LLMConfig, bool]:
    """The command line's options, the config they describe, and whether smoke mode is on."""
    parser = argparse.ArgumentParser(
        prog="python -m grpo_nb train",
        description="Asynchronous (or synchronous) GRPO on a Qwen-family model served by vLLM.")
    parser.add_argument("--smoke", action="store_true", help="small CI preset (or GRPO_NB_SMOKE=1)")
    parser.add_argument("--mode", choices=["async", "sync"], help="default: async")
    parser.add_argument("--model", help="model folder or hub id (default: the tiny character "
                        "model, built if needed)")
    parser.add_argument("--dataset", help="'arithmetic[:…]', a hub name such as openai/gsm8k, "
                        "or a .json/.jsonl/.parquet file or folder (GSM8K or messages format)")
    parser.add_argument("--resume", help="a run folder (runs/<name>) to continue from")
    parser.add_argument("--steps", type=int, help="total optimiser steps")
    parser.add_argument("--time-budget", type=float, help="seconds of training at most")
    parser.add_argument("--transport", choices=["gloo", "reload", "nccl", "ipc"],
                        help="weight sync (default by device: gloo on CPU, nccl/ipc on CUDA)")
    parser.add_argument("--backend", choices=["asyncio", "monarch"], default="asyncio",
                        help="actors in this process, or on torchmonarch processes")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="any LLMConfig field (repeatable), e.g. --set lr=1e-5")
    parser.add_argument("--name", help="run folder name under runs/")
    args = parser.parse_args(argv)
    smoke = args.smoke or smoke_mode()
    cfg = preset(LLMConfig, smoke)
    if args.resume:
        cfg = LLMConfig(**json.loads((Path(args.resume) / "config.json").read_text()))
    changes = {key: value for key, value in (
        ("mode", args.mode), ("steps", args.steps), ("model", args.model),
        ("dataset", args.dataset), ("time_budget_s", args.time_budget)) if value is not None}
    transport = [f"sync.transport={args.transport}"] if args.transport else []
    try:
        cfg = apply_sets(cfg.replace(**changes), [*args.set, *transport])
    except ValueError as err:
        parser.error(str(err))
    return args, cfg, smoke


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
        result = asyncio.run(train(cfg, name=args.name, resume=args.resume, on_event=on_event,
                                   smoke=smoke, backend=args.backend))
    except RunAborted as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    print(f"dashboard: {save_dashboard(result.run_dir)}", file=sys.stderr)
    print(json.dumps(json.loads((Path(result.run_dir) / "result.json").read_text())))
    return 0
