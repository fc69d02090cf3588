"""Weight-sync time per MB into a real vLLM-CPU server, against the floor on this machine.

    random Qwen3 (size via --hidden/--layers) ─► vLLM server (+ gloo engine)
        ├─ gloo   sync × N   (pause → [start + broadcast ∥ load_weights + finish] → version
        │                     → resume)
        ├─ reload sync × N   (safetensors to disk → /collective_rpc reload_weights)
        └─ floors: raw gloo broadcast of the same bytes between two local processes (same
                   loopback group as the engine), a memory copy of the same bytes, and
                   ``repack``: vLLM-CPU's own re-packing of every linear / embedding weight
                   into its GEMM kernels' layout (``dispatch_cpu_unquantized_gemm``, what any
                   load must end with), on the server's cores, for this model's fused shapes
    ─► one JSON line: MB, ms and MB/s for each, median ms per sync phase
       (``gloo_phases`` / ``reload_phases``), HTTP round trips per sync, one no-op RPC to the
       worker (``rpc_noop_ms``: the price of a round trip), and the load average
       before and after (the ratios, measured in one run, are what to compare across machines)

Run: ``.venv/bin/python benchmarks/weight_sync.py [--hidden 512 --layers 8 --repeats 5]
[--server-cpus auto|off|1]``.
The server start dominates the runtime (≈ 1–3 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _gloo_peer(port: int, nbytes: int, repeats: int) -> None:
    from grpo_nb.weight_sync.gloo_engine import open_group

    pg = open_group(1, 2, 60.0, port=port)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats + 1):
        pg.broadcast(buf, 0).wait()


def gloo_floor_ms(nbytes: int, repeats: int) -> float:
    """Median ms of a raw gloo broadcast of ``nbytes`` to one other local process."""
    from grpo_nb.weight_sync.gloo_engine import listen_loopback, open_group

    sock = listen_loopback()
    port = sock.getsockname()[1]
    peer = mp.get_context("spawn").Process(target=_gloo_peer, args=(port, nbytes, repeats))
    peer.start()
    try:
        pg = open_group(0, 2, 60.0, listen_socket=sock)
        buf = torch.ones(nbytes, dtype=torch.uint8)
        pg.broadcast(buf, 0).wait()  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            pg.broadcast(buf, 0).wait()
            times.append((time.perf_counter() - t) * 1e3)
    finally:
        peer.join(timeout=60)
        if peer.is_alive():
            peer.kill()
    return statistics.median(times)


def memcpy_floor_ms(nbytes: int, repeats: int) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _repack_child(shapes: list[tuple[int, int]], cpus: list[int] | None, repeats: int,
                  out: mp.Queue) -> None:
    if cpus:
        import os

        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layers = []
    for n, k in shapes:
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(n, k), requires_grad=False)
        layers.append(layer)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for layer in layers:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        times.append((time.perf_counter() - t) * 1e3)
    out.put(statistics.median(times[1:]))


def repack_floor_ms(hf_config: object, cpus: list[int] | None, repeats: int) -> float:
    """Median ms for vLLM-CPU to re-pack this model's weights, as its server does after a load.

    The shapes are vLLM's fused ones (q/k/v as one matrix, gate/up as one), run in a child
    process on the server's cores with as many threads (the server's own setting).
    """
    c: Any = hf_config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q),
                 (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    shapes = per_layer * c.num_hidden_layers + [(c.vocab_size, c.hidden_size)] * (
        1 if c.tie_word_embeddings else 2)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_repack_child, args=(shapes, cpus, repeats, results))
    child.start()
    try:
        while True:  # a child that dies (vLLM import, memory) is reported, not waited on
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                if not child.is_alive():
                    raise RuntimeError(f"the repack child exited ({child.exitcode}) "
                                       "without a result") from None
    finally:
        child.join(timeout=60)


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def _noop_rpc_ms(url: str, repeats: int) -> float:
    """Median ms of one HTTP → engine core → worker round trip that does nothing."""
    from grpo_nb.weight_sync import VLLMControlClient

    client = VLLMControlClient(url)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        client.collective_rpc("grpo_model_dtype")
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[1:])


def _measure(url: str, model: torch.nn.Module, transport: str, repeats: int,
             nbytes: int) -> dict:
    """Median ms (whole sync and each phase) of ``repeats`` syncs after one warm-up."""
    from grpo_nb.weight_sync import WeightSyncConfig, WeightSyncer

    wcfg = WeightSyncConfig(transport=transport, verify=False, timeout_s=120)
    with WeightSyncer(url, model, wcfg) as syncer:
        syncer.sync(0)  # warm-up (first load_weights, first buffer, first file write)
        results = [syncer.sync(v) for v in range(1, repeats + 1)]
        # a last sync, verified: the worker digests what it receives only when asked
        assert syncer.sync(repeats + 1, verify=True).verified, "served weights differ"
    med = statistics.median(r.ms for r in results)
    phases = {name: round(statistics.median(r.phases.get(name, 0.0) for r in results), 1)
              for name in results[0].phases}
    return {f"{transport}_ms": round(med, 1),
            f"{transport}_mb_per_s": round(nbytes / 1e6 / (med / 1e3), 1),
            f"{transport}_phases": phases, f"{transport}_round_trips": results[0].round_trips}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--server-cpus", default="auto",
                        help="the server tree's cores: 'auto' (the last core, as in a run), "
                             "'off' (unpinned: every core) or ids such as '1'")
    args = parser.parse_args(argv)

    from grpo_nb.serving.server import ServerConfig, VLLMServer
    from grpo_nb.tiny_model import TinyModelConfig, build_model, build_tokenizer
    from grpo_nb.weight_sync import WeightSyncConfig, model_bytes

    tok = build_tokenizer()
    cfg = TinyModelConfig(hidden_size=args.hidden, num_layers=args.layers, head_dim=64,
                          num_heads=max(1, args.hidden // 64), num_kv_heads=1,
                          ffn_size=4 * args.hidden)
    model = build_model(cfg, tok)
    nbytes = model_bytes(model)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    out: dict = {"loadavg_start": _loadavg(), "params_m": round(params_m, 2),
                 "mb": round(nbytes / 1e6, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        scfg = ServerConfig.smoke(Path(tmp))
        scfg.cpus = args.server_cpus
        for key, value in WeightSyncConfig().server_settings().items():
            setattr(scfg, key, value)
        server = VLLMServer(scfg).start(progress=False)
        server_cpus = list(server.cpus) if server.cpus else None
        try:
            out["rpc_noop_ms"] = round(_noop_rpc_ms(server.url, args.repeats), 1)
            for transport in ("gloo", "reload"):
                out.update(_measure(server.url, model, transport, args.repeats, nbytes))
        finally:
            server.stop()
    for name, fn in (("raw_gloo", gloo_floor_ms), ("memcpy", memcpy_floor_ms)):
        ms = fn(nbytes, args.repeats)
        out[f"{name}_ms"] = round(ms, 2)
        out[f"{name}_mb_per_s"] = round(nbytes / 1e6 / (ms / 1e3), 1)
    out["server_cpus"] = server_cpus
    out["repack_ms"] = round(repack_floor_ms(model.config, server_cpus, args.repeats), 1)
    out["gloo_over_raw"] = round(out["gloo_ms"] / out["raw_gloo_ms"], 2)
    # What no CPU transport can avoid: the bytes must arrive and the kernels must be re-packed.
    out["floor_ms"] = round(max(out["raw_gloo_ms"], out["repack_ms"]), 1)
    out["gloo_over_floor"] = round(out["gloo_ms"] / out["floor_ms"], 2)
    out["gloo_over_reload"] = round(out["gloo_ms"] / out["reload_ms"], 2)
    out["loadavg_end"] = _loadavg()
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
