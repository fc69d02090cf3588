"""vLLM-CPU start time and throughput: ``--enforce-eager`` vs ``torch.compile``, one run.

Why it exists: :class:`grpo_nb.serving.server.ServerConfig` has an ``eager`` switch, off by
default; this script measures what it trades (start time against generation speed)::

    tiny model ──► server (compiled) ──► startup s, tokens/s at each in-flight count
               └─► server (eager)    ──► startup s, tokens/s
                        ratios eager / compiled ──► one JSON line

The compile cache is warm for the second start of the same configuration, so the script
starts each mode twice and reports the second (the cost a user pays at every start).

Usage::

    python benchmarks/server_compile.py [--model DIR] [--prompts 32] [--new-tokens 32]

Measured 2026-11-30 on the 2-core CPU machine, nothing else running, smoke tiny model
(``--model .cache/models/tiny-qwen3-…``): start 63.2 s compiled vs 48.1 s eager (ratio
0.761); tokens/s 132.6 vs 91.3 at one request in flight (0.689), 1088.6 vs 688.1 at 16
(0.632). Compiled stays the default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from generation import _vllm_tokens_per_s  # noqa: E402  (a sibling script, not a package)


def _measure(model_dir: str, prompts: list[list[int]], new_tokens: int, eager: bool,
             in_flight: list[int]) -> dict:
    from grpo_nb.serving.server import ServerConfig, VLLMServer

    cfg = ServerConfig.smoke(model_dir)
    cfg.eager = eager
    cfg.max_model_len = max(cfg.max_model_len, len(prompts[0]) + new_tokens + 8)
    with VLLMServer(cfg):  # first start fills the compile cache (if compiling)
        pass
    with VLLMServer(cfg) as server:
        out = {"startup_s": round(server.startup_seconds, 1)}
        for n in in_flight:
            tps = asyncio.run(_vllm_tokens_per_s(server, prompts, new_tokens, n))
            out[f"tokens_per_s_{n}"] = round(tps, 1)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model folder (default: the tiny model, built if needed)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 16])
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset
    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    model_dir = args.model or str(build_or_load(TinyModelConfig()))
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = make_dataset(ArithmeticTaskConfig(n_train=10, n_test=args.prompts))["test"]
    prompts = [tok.encode(r, add_special_tokens=False) for r in rows["prompt"]]
    compiled = _measure(model_dir, prompts, args.new_tokens, False, args.in_flight)
    eager = _measure(model_dir, prompts, args.new_tokens, True, args.in_flight)
    result = {"model": Path(model_dir).name, "compiled": compiled, "eager": eager,
              "startup_ratio_eager_over_compiled":
                  round(eager["startup_s"] / compiled["startup_s"], 3)}
    for n in args.in_flight:
        key = f"tokens_per_s_{n}"
        result[f"throughput_ratio_eager_over_compiled_{n}"] = round(eager[key] / compiled[key], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
