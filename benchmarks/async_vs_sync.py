"""Async vs sync GRPO on the tiny model: wall-clock for the same number of steps.

    tiny model (SFT warm start) ─► one vLLM server (+ gloo engine)
        ├─ train(mode="async", steps=N) ─► wall_s, accuracy, staleness
        └─ train(mode="sync",  steps=N) ─► wall_s, accuracy
    ─► one JSON line with both and the ratio sync_wall / async_wall

Both runs share every setting but the schedule, and the server (so its compile cache and
warm-up cost neither run). Run:
``.venv/bin/python benchmarks/async_vs_sync.py [--steps 40]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict


async def _both(steps: int, seed: int) -> dict:
    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.llm.run import start_server, train
    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    model_dir = str(build_or_load(TinyModelConfig(), progress=False))
    base = LLMConfig(steps=steps, time_budget_s=None, eval_every=max(steps, 1),
                     eval_size=500, checkpoint_every=10_000, seed=seed)
    server = await asyncio.to_thread(start_server, model_dir, base, False)
    out: dict = {"steps": steps}
    try:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for mode in ("async", "sync"):
            res = await train(base.replace(mode=mode), model_dir=model_dir, server=server,
                              name=f"bench-{mode}-{stamp}", progress=False)
            out[mode] = {k: v for k, v in asdict(res).items() if k != "run_dir"}
    finally:
        await asyncio.to_thread(server.stop)
    out["speedup_async"] = round(out["sync"]["wall_s"] / out["async"]["wall_s"], 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = asyncio.run(_both(args.steps, args.seed))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
