"""Benchmark: what do grpo_nb.actors ports cost, against a raw asyncio.Queue and torchmonarch?

    python benchmarks/actors.py [--n 2000] [--ring-steps 60] [--no-monarch]

Measures, for a small int and for a toy-ring ``Group`` message (4 small tensors):
  latency     send one message, await it on the receiver, repeat (µs per message)
  throughput  send n messages, then receive all n (messages per second)
for ``asyncio.Queue`` (the floor: no copy), ``grpo_nb.actors`` ports (a pickle-style copy per
message) and, when installed, torchmonarch ports (same process, and from an actor in another
process). Then the toy ring's trainer steps per second on both runtimes. Prints a table, then
one JSON line with every figure::

    producer ──send──► port/queue ──► receiver      (latency: 1 in flight; throughput: n)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import torch

from grpo_nb import actors
from grpo_nb.toy.run import run_ring
from grpo_nb.toy.task import Group, ToyConfig


def payloads() -> dict[str, Any]:
    group = Group(torch.randn(4), torch.randint(0, 4, (8,)), torch.randn(8), 3, "gen0", time.time(),
                  torch.rand(8), torch.randn(8))
    return {"int": 7, "group": group}


async def measure(send: Callable[[Any], None], recv: Callable[[], Awaitable[Any]], msg: Any, n: int) -> dict[str, float]:
    for _ in range(min(n, 200)):  # warm-up
        send(msg)
        await recv()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        send(msg)
        await recv()
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n):
        send(msg)
    for _ in range(n):
        await recv()
    return {"latency_us": statistics.median(lat) * 1e6, "per_s": n / (time.perf_counter() - t0)}


async def bench_queue(msg: Any, n: int) -> dict[str, float]:
    q: asyncio.Queue[Any] = asyncio.Queue()
    return await measure(q.put_nowait, q.get, msg, n)


async def bench_ports(api: Any, msg: Any, n: int) -> dict[str, float]:
    port, receiver = api.Channel.open()
    return await measure(port.send, lambda: receiver.recv(), msg, n)


def _pump_class(api: Any) -> type:
    class Pump(api.Actor):
        @api.endpoint
        async def pump(self, msg: Any, n: int, port: Any) -> None:
            for _ in range(n):
                port.send(msg)

    return Pump


async def bench_monarch_cross_process(api: Any, msg: Any, n: int) -> dict[str, float]:
    """An actor in another process sends n messages to our port (throughput only)."""
    procs = api.this_host().spawn_procs(per_host={"gpus": 1})
    pump = procs.spawn("pump", _pump_class(api))
    port, receiver = api.Channel.open()
    await pump.pump.call_one(msg, 10, port)
    for _ in range(10):
        await receiver.recv()
    t0 = time.perf_counter()
    pump.pump.broadcast(msg, n, port)
    for _ in range(n):
        await receiver.recv()
    per_s = n / (time.perf_counter() - t0)
    await procs.stop()
    return {"latency_us": float("nan"), "per_s": per_s}


async def bench_ring(backend: str, steps: int) -> dict[str, float]:
    # No simulated decoding delay: the ring runs as fast as the runtime lets it.
    cfg = replace(ToyConfig.smoke(), steps=steps, backend=backend, gen_delay_s=0.0)
    t0 = time.perf_counter()
    result = await run_ring(cfg)
    return {"steps_per_s": result.steps_per_s, "ring_s": result.wall_s,
            "total_s": round(time.perf_counter() - t0, 2), "last_reward": result.last_reward}


async def main(n: int, ring_steps: int, with_monarch: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n, "ports": {}, "ring": {}}
    mon = actors.backend("monarch") if with_monarch else None
    for name, msg in payloads().items():
        row = {"queue": await bench_queue(msg, n), "grpo_nb": await bench_ports(actors, msg, n)}
        if mon is not None:
            row["monarch"] = await bench_ports(mon, msg, n)
            row["monarch_xproc"] = await bench_monarch_cross_process(mon, msg, n)
        out["ports"][name] = row
    out["ring"]["asyncio"] = await bench_ring("asyncio", ring_steps)
    if mon is not None:
        out["ring"]["monarch"] = await bench_ring("monarch", ring_steps)
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"{'message':<7} {'runtime':<14} {'latency µs':>11} {'x floor':>8} {'msgs/s':>10} {'x floor':>8}"]
    for name, row in res["ports"].items():
        floor = row["queue"]
        for runtime, r in row.items():
            lines.append(f"{name:<7} {runtime:<14} {r['latency_us']:>11.1f} {r['latency_us'] / floor['latency_us']:>8.1f} "
                         f"{r['per_s']:>10.0f} {floor['per_s'] / r['per_s']:>8.1f}")
    lines.append("")
    lines.append(f"{'ring':<22} {'steps/s':>8} {'ring s':>7} {'with start/stop s':>18}")
    for runtime, r in res["ring"].items():
        lines.append(f"{runtime:<22} {r['steps_per_s']:>8.1f} {r['ring_s']:>7.2f} {r['total_s']:>18.2f}")
    return "\n".join(lines)


def _finite(x: Any) -> Any:
    """NaN (no latency measured) is not JSON: write null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return None if isinstance(x, float) and x != x else x


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="messages per measurement")
    parser.add_argument("--ring-steps", type=int, default=60)
    parser.add_argument("--no-monarch", action="store_true", help="skip torchmonarch even if installed")
    args = parser.parse_args(argv)
    with_monarch = not args.no_monarch and actors.monarch_available()
    res = asyncio.run(main(args.n, args.ring_steps, with_monarch))
    print(table(res))
    print(json.dumps(_finite(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
