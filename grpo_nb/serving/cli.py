"""``python -m grpo_nb rollouts [--smoke] [--model PATH_OR_NAME]`` — rollouts end to end.

    tiny model (built or cached) or --model ──► LLMConfig: max_tokens, context length
        ──► VLLMServer (max_model_len = cfg.context_len; or --attach URL)
        ──► generate_groups(test prompts) ──► rewards, advantages, tokens/s
        ──► transformers model: logprob_agreement ──► LAST line: one JSON object

The server is stopped in a ``finally`` block, so the command leaves no vLLM process behind
even when generation fails or is interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from grpo_nb.config import preset


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m grpo_nb rollouts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="small CI sizes (also GRPO_NB_SMOKE=1)")
    p.add_argument("--model", help="model folder or hub name (default: the tiny model)")
    p.add_argument("--dataset", default=None,
                   help="hub math dataset / JSON / Parquet for a --model that is not the tiny "
                        "model (default openai/gsm8k)")
    p.add_argument("--attach", metavar="URL", help="use a running server instead of starting one")
    p.add_argument("--groups", type=int, default=None, help="prompts (default 16, smoke 8)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: 8 for the tiny model's arithmetic, 256 for math text; the "
                        "server's context is 256 (prompt) + this")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-in-flight", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    return p


def plan(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]]]:
    """``(cfg, rows)``: an :class:`~grpo_nb.llm.config.LLMConfig` for the model and data (the
    one source of ``max_tokens`` and of the server's context length, as in training) and the
    test rows to sample, for the tiny model or a user-given one."""
    from grpo_nb import tasks, tiny_model
    from grpo_nb.llm.config import LLMConfig

    n = args.groups or (8 if args.smoke else 16)
    if tiny_model.is_tiny_model(args.model):
        tiny = preset(tiny_model.TinyModelConfig, smoke=True if args.smoke else None)
        model_dir = Path(args.model) if args.model else tiny_model.build_or_load(tiny)
        task_cfg = tasks.ArithmeticTaskConfig(**tiny_model.load_meta(model_dir)["config"]["task"])
        rows = list(tasks.make_dataset(task_cfg)["test"].select(range(n)))
        model, dataset = str(model_dir), "arithmetic"
    else:
        model, dataset = args.model, args.dataset or "openai/gsm8k"
        rows = list(tasks.load_hub_math(dataset, "test").select(range(n)))
    return LLMConfig(model=model, dataset=dataset, max_tokens=args.max_tokens), rows


def server_config(cfg: Any, smoke: bool) -> Any:
    """The server for ``cfg``: its context holds the longest prompt kept plus ``max_tokens``
    (``cfg.context_len``), so no request can ask for more than the server allows."""
    from grpo_nb.serving.server import ServerConfig

    base = ServerConfig.smoke(cfg.model) if smoke else ServerConfig(model=cfg.model)
    return dataclasses.replace(base, max_model_len=cfg.context_len)


def fitting(rows: list[dict[str, Any]], tokenizer: Any, limit: int) -> list[dict[str, Any]]:
    """The rows whose rendered prompt has at most ``limit`` tokens (``cfg.max_prompt_len``)."""
    from grpo_nb.tasks import render_prompt

    return [r for r in rows if len(render_prompt(tokenizer, r)) <= limit]


async def _generate(server: Any, tokenizer: Any, rows: list[dict[str, Any]],
                    args: argparse.Namespace, max_tokens: int) -> tuple[list[Any], float, Any]:
    from grpo_nb.serving.client import ClientConfig, CompletionsClient
    from grpo_nb.serving.rollouts import SamplingConfig, generate_groups

    sampling = SamplingConfig(max_tokens=max_tokens, temperature=args.temperature,
                              seed=args.seed)
    async with CompletionsClient.for_server(
            server, ClientConfig(max_in_flight=args.max_in_flight)) as client:
        t0 = time.perf_counter()
        groups = await generate_groups(client, rows, args.group_size, tokenizer=tokenizer,
                                       sampling=sampling)
        return groups, time.perf_counter() - t0, client.stats


def cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_nb.serving.rollouts import logprob_agreement, summarize
    from grpo_nb.serving.server import VLLMServer

    cfg, rows = plan(args)
    model, max_tokens = cfg.model, cfg.max_tokens
    tokenizer = AutoTokenizer.from_pretrained(model)
    kept = fitting(rows, tokenizer, cfg.max_prompt_len)
    if len(kept) < len(rows):
        print(f"left out {len(rows) - len(kept)} prompts longer than {cfg.max_prompt_len} "
              "tokens", flush=True)
    rows = kept
    server = VLLMServer.attach(args.attach) if args.attach else VLLMServer(
        server_config(cfg, args.smoke))
    try:
        if not args.attach:
            print(f"starting vLLM for {model} …", flush=True)
            server.start()
            print(f"server ready in {server.startup_seconds} s at {server.url} "
                  f"(log {server.log_path})", flush=True)
        groups, seconds, stats = asyncio.run(_generate(server, tokenizer, rows, args,
                                                       max_tokens))
    finally:
        server.stop()
    for g in groups[:3]:
        print(f"{g.prompt!r} → {[r.completion_text for r in g.rollouts]} "
              f"rewards {g.rewards} advantages {[round(a, 2) for a in g.advantages]}")
    import torch

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    agreement = logprob_agreement(hf, groups)
    result = {**summarize(groups, seconds),
              "max_abs_logprob_diff": agreement["max_abs_diff"],
              "logprob_tolerance": agreement["tolerance"],
              "failed_requests": stats.failed, "startup_s": server.startup_seconds, "server_id": server.server_id,
              "model": model}
    print(json.dumps(result))
    return 0 if agreement["max_abs_diff"] <= agreement["tolerance"] and not stats.failed else 1
