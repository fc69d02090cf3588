"""The LLM commands: ``python -m grpo_nb train``, a headless GRPO run (progress bar, dashboard PNG,
JSON summary last), and ``python -m grpo_nb rollouts``, scored groups sampled as the ring samples
them. Both read their options into an LLMConfig one way: a flag whose ``dest`` is a field sets it,
and ``--set FIELD=VALUE`` takes any field, read by the field's type."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from grpo_nb.config import (
    InputError,
    given_fields,
    json_where,
    parse_sets,
    preset,
    smoke_mode,
    utf8_text,
)
from grpo_nb.llm.config import LLMConfig
from grpo_nb.metrics import MetricsRecorder

_FIELDS = {f.name for f in fields(LLMConfig)}


def apply_sets(cfg: LLMConfig, assignments: list[str],
               values: dict[str, Any] | None = None) -> LLMConfig:
    """``cfg`` with ``values`` and then ``FIELD=VALUE`` assignments (:func:`config.parse_sets`),
    both by field name (``sync.FIELD``: the weight sync's), checked."""
    values = {**(values or {}), **parse_sets(LLMConfig, assignments)}
    if "sync" in values:
        raise ValueError("--set sync=…: set the weight sync's fields one by one, sync.FIELD=VALUE")
    sync = {k.removeprefix("sync."): values.pop(k) for k in list(values) if k.startswith("sync.")}
    if sync:
        values["sync"] = {**asdict(cfg.sync), **sync}
        if "pause_mode" not in sync and (cfg.sync.pause_mode in ("none", "auto")
                                         or "sync.pause_mode" in (cfg.defaults or {})):
            values["sync"]["pause_mode"] = "auto"  # the ring's for the transport (resolve)
    return cfg.replace(**values)


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    """The options both commands take; a command adds its own (see :func:`_configure`)."""
    p = argparse.ArgumentParser(prog=f"python -m grpo_nb {command}", description=description)
    p.add_argument("--smoke", action="store_true", help="small CI preset (or GRPO_NB_SMOKE=1)")
    p.add_argument("--model", help="model folder or hub id (default: the tiny character "
                   "model, built if needed)")
    p.add_argument("--dataset", help="'arithmetic[:…]', a hub name such as openai/gsm8k, "
                   "or a .json/.jsonl/.parquet file or folder (GSM8K or messages format)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any LLMConfig field (repeatable), e.g. --set lr=1e-5")
    return p


def _configure(parser: argparse.ArgumentParser, args: argparse.Namespace,
               cfg: LLMConfig) -> LLMConfig:
    """``cfg`` with each flag given whose ``dest`` is a field (or ``sync.FIELD``), then the
    ``--set`` ones, resolved (:meth:`LLMConfig.resolve`); a bad value exits with the usage."""
    try:
        return apply_sets(cfg, args.set, given_fields(args, LLMConfig)).resolve()
    except ValueError as err:
        parser.error(str(err))


def parse_config(argv: list[str]) -> tuple[argparse.Namespace, LLMConfig, bool]:
    """``train``'s options, the config they describe, and whether smoke mode is on."""
    p = _parser("train", "Asynchronous (or synchronous) GRPO on a Qwen-family model served "
                "by vLLM.")
    p.add_argument("--mode", choices=["async", "sync"], help="default: async")
    p.add_argument("--resume", help="a run folder (runs/<name>) to continue from")
    p.add_argument("--steps", type=int, help="total optimiser steps")
    p.add_argument("--time-budget", dest="time_budget_s", type=float, metavar="SECONDS",
                   help="seconds of training at most")
    p.add_argument("--transport", dest="sync.transport", choices=["gloo", "reload", "nccl", "ipc"],
                   help="weight sync (default by device: gloo on CPU; on CUDA nccl with 2+ "
                   "GPUs, ipc with one); the pause mode follows it unless sync.pause_mode is set")
    p.add_argument("--backend", choices=["asyncio", "monarch"], default="asyncio",
                   help="actors in this process, or on torchmonarch processes")
    p.add_argument("--name", help="run folder name under runs/")
    p.add_argument("--attach", metavar="URL", help="train on a running vLLM server that serves "
                   "--model (its weights are overwritten) instead of starting one")
    args = p.parse_args(argv)
    smoke = args.smoke or smoke_mode()
    cfg = preset(LLMConfig, smoke)
    if args.resume:
        try:
            cfg = resumed_config(Path(args.resume))
        except InputError as err:
            p.error(str(err))
    return args, _configure(p, args, cfg), smoke


RUN_FOLDER = ("a run folder (runs/<name>, written by `python -m grpo_nb train`) holds config.json "
              "and checkpoint/trainer_state.json")


def resumed_config(folder: Path) -> LLMConfig:
    """The config a run folder was trained with, once it is known to hold a checkpoint to resume;
    :class:`InputError` naming the folder or file and what a run folder holds, if not."""
    from grpo_nb.llm.policy import STATE

    path = folder / "config.json"
    if not folder.is_dir():
        raise InputError(f"--resume {folder}: no such folder; {RUN_FOLDER}")
    if not path.is_file():
        raise InputError(f"--resume {folder}: no config.json in it; {RUN_FOLDER}")
    try:
        values = json.loads(utf8_text(path))
    except ValueError as err:  # not UTF-8 or not JSON
        where = json_where(err) if isinstance(err, json.JSONDecodeError) else err
        raise InputError(f"--resume {folder}: {path}, {where}; expected the JSON object of "
                         "LLMConfig fields that `train` wrote there") from None
    if not isinstance(values, dict):
        raise InputError(f"--resume {folder}: {path} holds a JSON {type(values).__name__}; "
                         "expected the JSON object of LLMConfig fields that `train` wrote there")
    if unknown := sorted(set(values) - _FIELDS):
        raise InputError(f"--resume {folder}: {path} has field(s) {', '.join(unknown)} that "
                         "LLMConfig does not know; remove them")
    try:
        cfg = LLMConfig(**values)
    except (TypeError, ValueError) as err:
        raise InputError(f"--resume {folder}: {path}: {err}") from None
    if not (folder / "checkpoint" / STATE).is_file():
        raise InputError(f"--resume {folder}: no complete checkpoint in it "
                         f"(checkpoint/{STATE} is missing: the run ended before its first); "
                         f"{RUN_FOLDER}. Start afresh without --resume")
    return cfg


def cli(argv: list[str]) -> int:
    """``train``: run, show progress on stderr, save the dashboard PNG, print the JSON summary
    last."""
    from grpo_nb.live import StepBar
    from grpo_nb.llm.dashboard import save_dashboard
    from grpo_nb.llm.run import RunAborted, train
    from grpo_nb.serving.server import VLLMServer

    args, cfg, smoke = parse_config(argv)
    bar = StepBar(cfg.steps, f"GRPO {cfg.mode}", reward=".2f", dropped="")

    def on_event(kind: str, rec: MetricsRecorder) -> None:
        if kind == "step":
            bar.step(rec.rows("step")[-1])
        elif kind == "eval":
            row = rec.rows("eval")[-1]
            bar.write(f"step {row['step']}: test accuracy {row['accuracy']:.3f}")

    try:
        server = VLLMServer.attach(args.attach) if args.attach else None
        result = asyncio.run(train(cfg, name=args.name, resume=args.resume, on_event=on_event,
                                   smoke=smoke, backend=args.backend, server=server))
    except InputError as err:  # a dataset file: found while loading it, before any server
        print(f"python -m grpo_nb train: error: {err}", file=sys.stderr)
        return 2
    except RunAborted as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    print(f"dashboard: {save_dashboard(result.run_dir)}", file=sys.stderr)
    print(json.dumps(json.loads((Path(result.run_dir) / "result.json").read_text())))
    return 0


def parse_rollouts(argv: list[str]) -> tuple[argparse.Namespace, LLMConfig, bool]:
    """``rollouts``' options, the config they describe (as in training: the one source of
    ``max_tokens`` and the server's context length), and whether smoke mode is on."""
    from grpo_nb.tiny_model import build_or_load, is_tiny_model

    p = _parser("rollouts", "Serve a model with vLLM, sample scored groups as the ring does, "
                "check vLLM's log-probs against transformers'; the last line is one JSON object. "
                "The server is always stopped. The tiny model samples arithmetic, another "
                "--model openai/gsm8k unless --dataset names other data.")
    p.add_argument("--attach", metavar="URL", help="use a running server instead of starting one")
    p.add_argument("--groups", dest="eval_size", type=int, metavar="GROUPS",
                   help="prompts (default 16, smoke 8)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int,
                   help="default: 8 for the tiny model's arithmetic, 256 for math text")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-in-flight", type=int, default=32, help="requests at once")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    smoke = args.smoke or smoke_mode()
    if is_tiny_model(args.model):
        args.model, args.dataset = str(args.model or build_or_load()), "arithmetic"
    base = LLMConfig(dataset="openai/gsm8k", eval_size=8 if smoke else 16,
                     max_inflight=max(64, args.group_size))
    return args, _configure(p, args, base), smoke


def rollouts(argv: list[str]) -> int:
    """``rollouts``: a group per test prompt, three of them printed, then one JSON line; exit 1
    when vLLM's log-probs disagree with transformers' or a request failed."""
    from grpo_nb import tasks
    from grpo_nb.llm import placement
    from grpo_nb.llm.data import load_data
    from grpo_nb.llm.policy import load_policy
    from grpo_nb.llm.rollouts import logprob_agreement, sample_groups, summarize
    from grpo_nb.llm.run import server_for
    from grpo_nb.serving.client import ClientConfig, CompletionsClient
    from grpo_nb.serving.server import VLLMServer

    args, cfg, smoke = parse_rollouts(argv)
    hf, tokenizer = load_policy(cfg.model, trainable=False)
    data = load_data(tokenizer, cfg, smoke)  # the test split's first ones
    if data.filtered:
        print(f"left out {data.filtered} prompts longer than {cfg.max_prompt_len} tokens")
    reward = tasks.make_reward(cfg.reward, default=data.reward_default)
    server = VLLMServer.attach(args.attach) if args.attach else server_for(cfg.model, cfg)

    async def sample() -> tuple[list[Any], float, Any]:
        async with CompletionsClient.for_server(
                server, ClientConfig(max_in_flight=args.max_in_flight)) as client:
            t0 = time.perf_counter()
            groups = await sample_groups(client, data.test, cfg, reward=reward, seed=cfg.seed)
            return groups, time.perf_counter() - t0, client.stats

    try:
        if not args.attach:
            print(f"starting vLLM for {cfg.model} …", flush=True)
            server.start()
            print(f"server ready in {server.startup_seconds} s at {server.url} "
                  f"(log {server.log_path})", flush=True)
        groups, seconds, stats = asyncio.run(sample())
    finally:
        server.stop()
    for g in groups[:3]:
        print(f"{g.prompt!r} → {[r.completion_text for r in g.rollouts]} "
              f"rewards {g.rewards} advantages {[round(r.advantage, 2) for r in g.rollouts]}")
    agreement = logprob_agreement(hf, groups, temperature=cfg.temperature,
                                  dtype=placement.dtype_of(cfg))  # the server's dtype
    result = {**summarize(groups, seconds), "max_abs_logprob_diff": agreement["max_abs_diff"],
              "logprob_tolerance": agreement["tolerance"], "temperature": cfg.temperature,
              "failed_requests": stats.failed,
              "startup_s": server.startup_seconds, "server_id": server.server_id,
              "model": cfg.model}
    print(json.dumps(result))
    return 0 if agreement["max_abs_diff"] <= agreement["tolerance"] and not stats.failed else 1
