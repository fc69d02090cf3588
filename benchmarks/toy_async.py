"""When does asynchrony pay? The toy ring, sync vs async, as generation time grows a tail.

Prints one JSON line: for each tail (log-normal σ of the per-group decode time), the measured
seconds per step in each mode, the speed-up, the cost model's prediction
(grpo_nb.toy.run.predict) and the staleness async mode pays for it. No server, no GPU:
decode and train times are simulated (asyncio sleeps), which is what makes the toy a model of
separate generation and training devices. Run it alone on a quiet machine::

    python benchmarks/toy_async.py [--steps 40] [--tails 0 0.75 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from grpo_nb.toy.run import sweep_config, tail_sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tails", type=float, nargs="+", default=[0.0, 0.75, 1.5])
    parser.add_argument("--gen-delay", type=float, default=0.04)
    parser.add_argument("--train-delay", type=float, default=0.04)
    args = parser.parse_args()
    base = sweep_config(steps=args.steps, gen_delay_s=args.gen_delay, train_delay_s=args.train_delay)
    points = asyncio.run(tail_sweep(base, tuple(args.tails)))
    print(json.dumps({
        "benchmark": "toy_async",
        "steps": args.steps,
        "gen_delay_s": args.gen_delay,
        "train_delay_s": args.train_delay,
        "load_avg": os.getloadavg()[0],
        "points": [{
            "tail": p.tail,
            "sync_step_s": round(p.sync_step_s, 4),
            "async_step_s": round(p.async_step_s, 4),
            "speedup_async": round(p.speedup, 3),
            "predicted_speedup": round(p.predicted_speedup, 3),
            "staleness_async": round(p.staleness_async, 3),
        } for p in points],
    }))


if __name__ == "__main__":
    main()
