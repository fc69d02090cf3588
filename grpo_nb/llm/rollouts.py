"""Sampling a group from the vLLM server, the one way the ring, notebook 04 and ``python -m
grpo_nb rollouts`` do it (one request with ``n = group_size``); rewards; held-out evaluation."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, Prompt, Rollout
from grpo_nb.serving.client import CompletionsClient, policy_salt

# fp32 on both sides: vLLM's and transformers' kernels agree far inside this.
LOGPROB_TOLERANCE = 1e-4


def sampling_request(cfg: LLMConfig, version: int, seed: int | None = None) -> dict[str, Any]:
    """One group's request: ``top_p`` 1, as the trainer's log-probs are the full softmax, and
    salted so that vLLM never reuses prompt KV that other weights computed."""
    return {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "top_p": 1.0,
            "n": cfg.group_size, "cache_salt": policy_salt(version),
            **({} if seed is None else {"seed": seed})}


async def sample_group(client: CompletionsClient, prompt: Prompt, cfg: LLMConfig,
                       version: Callable[[], int] = lambda: 0, *, group_id: int = 0,
                       source: str = "", seed: int | None = None,
                       on_abort: Callable[[], None] | None = None) -> Group:
    """``cfg.group_size`` completions of ``prompt``, unscored; ``version()`` is the served weight
    version. A group a sync cut short is not one policy's: it is sampled again (``on_abort``)."""
    while True:
        v, start = version(), time.time()
        outs = await client.complete(prompt.ids, **sampling_request(cfg, v, seed))
        if not any(o.finish_reason == "abort" for o in outs):
            break
        if on_abort is not None:
            on_abort()
    rollouts = [Rollout(list(prompt.ids), o.token_ids, o.logprobs, o.text, o.finish_reason,
                        policy_version=v, group_id=group_id, latency_s=o.latency_s)
                for o in outs]
    return Group(group_id, prompt.text, prompt.answer, list(prompt.ids), rollouts, v,
                 t_submit=start, t_done=time.time(), source=source)


def reward_group(group: Group, reward: Callable[[str, str], float]) -> Group:
    """Set each rollout's reward; a completion cut at ``max_tokens`` (not ``"stop"``) scores 0:
    the answer must be followed by end-of-sequence."""
    for r in group.rollouts:
        r.reward = float(reward(r.completion_text, group.answer)) \
            if r.finish_reason == "stop" else 0.0
    return group


async def sample_groups(client: CompletionsClient, prompts: Sequence[Prompt], cfg: LLMConfig,
                        *, reward: Callable[[str, str], float] | None = None,
                        seed: int | None = None) -> list[Group]:
    """A group per prompt, all in flight at once, in order; rewarded when ``reward`` is given."""
    tasks = [asyncio.ensure_future(sample_group(
        client, p, cfg, group_id=i, seed=None if seed is None else seed + i * cfg.group_size))
        for i, p in enumerate(prompts)]
    try:
        groups = await asyncio.gather(*tasks)
    finally:  # one failed group: cancel (and wait for) the others, never leave them running
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [reward_group(g, reward) for g in groups] if reward is not None else groups


def flatten(groups: Sequence[Group]) -> list[Rollout]:
    return [r for g in groups for r in g.rollouts]


def logprob_agreement(model: Any, groups: Sequence[Group]) -> dict[str, float]:
    """vLLM's sampler log-probs against ``model``'s, token by token (sample at temperature 1)."""
    from grpo_nb.llm.policy import completion_logprobs

    rollouts = flatten(groups)
    if not rollouts:
        raise ValueError("no rollouts to compare")
    diffs = torch.cat([(mine - torch.tensor(r.sampler_logprobs)).abs() for mine, r in
                       zip(completion_logprobs(model, rollouts), rollouts, strict=True)])
    return {"max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
            "tokens": int(diffs.numel()), "tolerance": LOGPROB_TOLERANCE}


def summarize(groups: Sequence[Group], seconds: float) -> dict[str, Any]:
    """Accuracy (mean correctness of samples), tokens/s, groups and mixed-reward groups."""
    rollouts = flatten(groups)
    tokens = sum(len(r.completion_ids) for r in rollouts)
    return {"groups": len(groups), "samples": len(rollouts),
            "accuracy": sum(r.reward >= 1.0 for r in rollouts) / max(1, len(rollouts)),
            "mixed_groups": sum(len(set(g.rewards)) > 1 for g in groups), "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


@dataclass
class EvalResult:
    accuracy: float  # greedy, on the held-out prompts
    n: int
    truncated: int  # completions that hit max_tokens (scored wrong)


async def greedy_accuracy(client: Any, prompts: Sequence[Prompt],
                          checker: Callable[[str, str], float], max_tokens: int, *,
                          batch: int = 64, cache_salt: str | None = None) -> EvalResult:
    """Held-out accuracy of greedy samples (``batch`` prompts a request), a truncated one wrong."""
    if not prompts:
        return EvalResult(float("nan"), 0, 0)

    async def chunk(part: Sequence[Prompt]) -> list[Any]:
        outs = await client.complete([list(p.ids) for p in part], max_tokens=max_tokens,
                                     temperature=0.0, n=1,
                                     **({"cache_salt": cache_salt} if cache_salt else {}))
        if len(outs) != len(part):
            raise RuntimeError(f"evaluation: {len(part)} prompts, {len(outs)} completions")
        return outs

    parts = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    results = await asyncio.gather(*(chunk(p) for p in parts))
    correct = truncated = 0
    for prompt, out in zip(prompts, (o for outs in results for o in outs), strict=True):
        if out.prompt_token_ids is not None and list(out.prompt_token_ids) != list(prompt.ids):
            raise RuntimeError("evaluation: completions came back out of prompt order")
        truncated += out.finish_reason == "length"
        correct += out.finish_reason == "stop" and checker(out.text, prompt.answer) >= 1.0
    return EvalResult(correct / len(prompts), len(prompts), truncated)


def _parser() -> argparse.ArgumentParser:
    """``python -m grpo_nb rollouts``'s options."""
    p = argparse.ArgumentParser(
        prog="python -m grpo_nb rollouts", description="Serve a model with vLLM, sample scored "
        "groups as the ring does, check vLLM's log-probs against transformers'; the last line "
        "is one JSON object. The server is always stopped.")
    p.add_argument("--smoke", action="store_true", help="small CI sizes (also GRPO_NB_SMOKE=1)")
    p.add_argument("--model", help="model folder or hub name (default: the tiny model)")
    p.add_argument("--dataset", default=None,
                   help="hub math dataset / JSON / Parquet for a --model that is not the tiny "
                        "model (default openai/gsm8k)")
    p.add_argument("--attach", metavar="URL", help="use a running server instead of starting one")
    p.add_argument("--groups", type=int, default=None, help="prompts (default 16, smoke 8)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: 8 for the tiny model's arithmetic, 256 for math text")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-in-flight", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    return p


def plan(args: argparse.Namespace) -> LLMConfig:
    """The config, as in training: the one source of ``max_tokens`` and the context length."""
    from grpo_nb import tiny_model
    from grpo_nb.config import preset

    model, dataset = args.model, args.dataset or "openai/gsm8k"
    if tiny_model.is_tiny_model(args.model):
        tiny = preset(tiny_model.TinyModelConfig, smoke=True if args.smoke else None)
        model, dataset = str(args.model or tiny_model.build_or_load(tiny)), "arithmetic"
    return LLMConfig(model=model, dataset=dataset, max_tokens=args.max_tokens,
                     group_size=args.group_size, temperature=args.temperature,
                     max_inflight=max(64, args.group_size), seed=args.seed,
                     eval_size=args.groups or (8 if args.smoke else 16))


def cli(argv: list[str]) -> int:
    from grpo_nb import grpo, tasks
    from grpo_nb.config import smoke_mode
    from grpo_nb.llm.data import load_data
    from grpo_nb.llm.placement import server_config
    from grpo_nb.llm.policy import load_policy
    from grpo_nb.serving.client import ClientConfig
    from grpo_nb.serving.server import VLLMServer

    args = _parser().parse_args(argv)
    cfg = plan(args)
    hf, tokenizer = load_policy(cfg.model, trainable=False)
    data = load_data(tokenizer, cfg, args.smoke or smoke_mode())  # the test split's first ones
    if data.filtered:
        print(f"left out {data.filtered} prompts longer than {cfg.max_prompt_len} tokens")
    reward = tasks.make_reward(cfg.reward, default=data.reward_default)
    server = VLLMServer.attach(args.attach) if args.attach else VLLMServer(
        server_config(cfg.model, cfg))  # as a training server is

    async def sample() -> tuple[list[Group], float, Any]:
        async with CompletionsClient.for_server(
                server, ClientConfig(max_in_flight=args.max_in_flight)) as client:
            t0 = time.perf_counter()
            groups = await sample_groups(client, data.test, cfg, reward=reward, seed=args.seed)
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
        adv = grpo.group_advantages(torch.tensor(g.rewards), cfg.group_size,
                                    scale=cfg.adv_scale)
        print(f"{g.prompt!r} → {[r.completion_text for r in g.rollouts]} "
              f"rewards {g.rewards} advantages {[round(a, 2) for a in adv.tolist()]}")
    agreement = logprob_agreement(hf, groups)
    result = {**summarize(groups, seconds), "max_abs_logprob_diff": agreement["max_abs_diff"],
              "logprob_tolerance": agreement["tolerance"], "failed_requests": stats.failed,
              "startup_s": server.startup_seconds, "server_id": server.server_id,
              "model": cfg.model}
    print(json.dumps(result))
    return 0 if agreement["max_abs_diff"] <= agreement["tolerance"] and not stats.failed else 1
