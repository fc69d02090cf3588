"""The probe's checks that need a second process on the trainer's GPU (see ``gpu_probe``)::

    cuda_ipc    a model of the probe's shape with Qwen3-0.6B's 28 layers (310 tensors) in
                float32, sent as the syncer sends over vLLM's IPC engine: on a thread of its
                own ("grpo-transfer") under ``weight_sync.syncer.device_scope``, every
                parameter cast to bfloat16 (``weight_sync.verify.sent_tensors``), made
                contiguous and exported with ``reduce_tensor``, keyed by the GPU's UUID; a
                spawned child finds its own UUID, rebuilds each (``rebuild_cuda_tensor``, the
                device index replaced, as vLLM's worker does) and digests it: the digests
                equal ``verify.expected_digests``, and the child's in-place write to one
                tensor reaches the parent
    contention  trainer steps at the GPU run's batch timed alone, then while a spawned child
                runs a decode-like loop on the same GPU (a batch of one-token steps through
                bf16 weights of the model's shape, each ending in a CPU sync as sampling
                does); both slowdowns, and ``work_done_together`` = the sum of the two rates
                as fractions of their rates alone: 1.0 when the two CUDA contexts only
                time-slice (overlap gains nothing on one GPU), 2.0 when neither slows the other

Both report ``{"skipped": "no CUDA"}`` without CUDA; :func:`measure_contention` itself runs
on any device (a test drives it on the CPU).
"""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from types import SimpleNamespace

    from grpo_nb.llm.config import LLMConfig

IPC_LAYERS = 28  # Qwen3-0.6B's layers: 28 x 11 tensors + embedding + final norm = 310
CHILD_TIMEOUT_S = 120.0  # a spawned child imports torch and initialises CUDA
CONTENTION_STEPS = 3  # timed trainer steps each way, after one warm-up step
DECODE_BATCH = 64  # sequences one decode step advances (the GPU run's max_inflight)
DECODE_ALONE_S = 3.0  # how long the child measures its own rate before the trainer steps


def _spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    """``target(*args, conn)`` in a spawned daemon process: (the process, our end)."""
    mp = torch.multiprocessing.get_context("spawn")
    ours, theirs = mp.Pipe()
    child = mp.Process(target=target, args=(*args, theirs), daemon=True)
    child.start()
    return child, ours


def _reap(child: Any) -> None:
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join(timeout=10)


def _answer(conn: Any, what: str) -> dict[str, Any]:
    if not conn.poll(CHILD_TIMEOUT_S):
        return {"error": f"no {what} from the child in {CHILD_TIMEOUT_S:.0f} s"}
    return conn.recv()


# ── cuda_ipc ──


def _ipc_child(names: list[str], handles: list[dict[str, tuple]], device_index: int,
               conn: Any) -> None:
    """In a spawned process: rebuild every exported tensor from its IPC handle (looked up by
    this GPU's UUID), digest each, add 1 in place to the first (the parent must see it)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from grpo_nb.weight_sync.verify import digest

    try:
        torch.cuda.set_device(device_index)
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        t0 = time.perf_counter()
        rebuilt = []
        for handle in handles:
            args = list(handle[uuid])
            args[6] = device_index  # the exporter's device index, as vLLM's worker sets it
            rebuilt.append(rebuild_cuda_tensor(*args))
        seen = [[name, digest(t)] for name, t in zip(names, rebuilt, strict=True)]
        rebuilt[0].add_(1.0)
        torch.cuda.synchronize(device_index)
        conn.send({"received": seen, "child_rebuild_and_digest_s":
                   round(time.perf_counter() - t0, 2), "child_device": str(rebuilt[0].device)})
    except BaseException as err:  # the parent reports it
        conn.send({"error": f"{err!r}\n{traceback.format_exc()[-1500:]}"})
    finally:
        conn.close()


def _export(model: torch.nn.Module, dtype: torch.dtype, device: torch.device
            ) -> dict[str, Any]:
    """What the syncer's transfer thread does with vLLM's IPC engine, on such a thread: the
    engine's GPU named from the current device under the scope, then every sent tensor
    exported. ``refs`` keep the exported copies alive (IPC handles do not)."""
    from torch.multiprocessing.reductions import reduce_tensor

    from grpo_nb.weight_sync.syncer import device_scope
    from grpo_nb.weight_sync.verify import sent_tensors

    out: dict[str, Any] = {"names": [], "refs": [], "handles": []}

    def send() -> None:
        with device_scope(device):
            index = torch.cuda.current_device()
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            for name, tensor in sent_tensors(model, dtype):
                weight = tensor.detach().contiguous()
                out["names"].append(name)
                out["refs"].append(weight)
                out["handles"].append({uuid: reduce_tensor(weight)[1]})
            torch.cuda.synchronize(device)
        out["thread_device"] = index

    def run() -> None:
        try:
            send()
        except BaseException as err:  # reported in the line
            out["error"] = f"{err!r}\n{traceback.format_exc()[-1500:]}"

    t0 = time.perf_counter()
    thread = threading.Thread(target=run, name="grpo-transfer", daemon=True)
    thread.start()
    thread.join(CHILD_TIMEOUT_S)
    if thread.is_alive():
        out["error"] = f"the export did not finish in {CHILD_TIMEOUT_S:.0f} s"
    out["export_s"] = round(time.perf_counter() - t0, 2)
    return out


def cuda_ipc(ctx: SimpleNamespace) -> dict[str, Any]:
    if not ctx.cuda:
        return {"skipped": "no CUDA"}
    from gpu_probe import build_model

    from grpo_nb.weight_sync.verify import compare, expected_digests

    device, dtype = ctx.device, torch.bfloat16  # what a bf16 server receives
    model = build_model({**ctx.shape, "num_hidden_layers": IPC_LAYERS}, device)
    expected = expected_digests(model, dtype)
    sent = _export(model, dtype, device)
    out: dict[str, Any] = {"device": str(device), "tensors": len(sent["names"]),
                           "mib": round(sum(t.nbytes for t in sent["refs"]) / 2**20, 1),
                           "send_dtype": "bfloat16", "export_s": sent["export_s"],
                           "export_thread_device": sent.get("thread_device")}
    if "error" in sent:
        return {**out, "ok": False, "error": sent["error"]}
    first_after = sent["refs"][0] + 1.0  # what the child's in-place add must leave
    t0 = time.perf_counter()
    child, conn = _spawn(_ipc_child, sent["names"], sent["handles"], device.index)
    try:
        reply = _answer(conn, "digests")
    finally:
        _reap(child)
    out["spawn_to_answer_s"] = round(time.perf_counter() - t0, 2)
    if "error" in reply:
        return {**out, "ok": False, "error": reply["error"]}
    torch.cuda.synchronize(device)
    problem = compare(expected, reply.pop("received"))
    out.update(reply)
    out["child_saw_the_same_bytes"] = problem is None
    if problem is not None:
        out["digest_problem"] = problem
    out["parent_sees_the_childs_write"] = bool(torch.equal(sent["refs"][0], first_after))
    out["ok"] = out["child_saw_the_same_bytes"] and out["parent_sees_the_childs_write"]
    del sent
    torch.cuda.ipc_collect()
    return out


# ── contention ──


def _decode_weights(shape: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Random bf16 matrices of the model's shape: per layer the fused q/k/v, o, gate/up and
    down projections; the embedding doubles as the head (tied, as Qwen3-0.6B's)."""
    gen = torch.Generator(device=device).manual_seed(2)
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]

    def w(*size: int) -> torch.Tensor:
        return 0.02 * torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16)

    return {"q": q, "inter": i, "embed": w(shape["vocab_size"], h),
            "layers": [(w(h, q + 2 * kv), w(q, h), w(h, 2 * i), w(i, h))
                       for _ in range(shape["num_hidden_layers"])]}


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def decode_step(x: torch.Tensor, weights: dict[str, Any]) -> torch.Tensor:
    """One token for each row of ``x``: the layers' matmuls, the head, a greedy pick read on
    the CPU (a sampler's sync), the picked tokens' embeddings (the next step's input)."""
    q, inter = weights["q"], weights["inter"]
    for wqkv, wo, wgu, wd in weights["layers"]:
        x = x + (_norm(x) @ wqkv)[:, :q] @ wo
        gate, up = (_norm(x) @ wgu).split(inter, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ wd
    tokens = (_norm(x) @ weights["embed"].T).argmax(-1).cpu()
    return weights["embed"][tokens.to(x.device)]


def _decode_child(shape: dict[str, Any], device_name: str, alone_s: float, conn: Any) -> None:
    """In a spawned process: decode steps, their rate over ``alone_s`` (sent), then until
    the parent says stop (the rate meanwhile sent)."""
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        weights = _decode_weights(shape, device)
        x = weights["embed"][:DECODE_BATCH].clone()
        for _ in range(3):  # kernels chosen, memory allocated
            x = decode_step(x, weights)
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < alone_s:
            x, steps = decode_step(x, weights), steps + 1
        conn.send({"alone_steps_per_s": steps / (time.perf_counter() - t0)})
        steps, t0 = 0, time.perf_counter()
        while not conn.poll():
            x, steps = decode_step(x, weights), steps + 1
        conn.recv()
        conn.send({"beside_steps_per_s": steps / (time.perf_counter() - t0), "steps": steps})
    except BaseException as err:  # the parent reports it
        conn.send({"error": f"{err!r}\n{traceback.format_exc()[-1500:]}"})
    finally:
        conn.close()


def _timed_steps(trainer: Any, batch: list[Any], device: torch.device, n: int) -> list[float]:
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        trainer.step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def measure_contention(shape: dict[str, Any], device: torch.device, cfg: LLMConfig,
                       steps: int = CONTENTION_STEPS, alone_s: float = DECODE_ALONE_S
                       ) -> dict[str, Any]:
    """Trainer step times alone and beside the decode child, and the child's rates."""
    from gpu_probe import _trainer, groups

    trainer = _trainer(shape, device, cfg)
    batch = groups(cfg, shape["vocab_size"], cfg.max_prompt_len, cfg.max_tokens)
    trainer.step(batch)  # warm-up: AdamW's state allocated, kernels chosen
    alone = _timed_steps(trainer, batch, device, steps)
    out: dict[str, Any] = {"device": str(device), "decode_batch": DECODE_BATCH,
                           "batch": f"{cfg.batch_size} sequences x {cfg.context_len} tokens",
                           "trainer_step_s_alone": round(statistics.median(alone), 4)}
    child, conn = _spawn(_decode_child, shape, str(device), alone_s)
    try:
        first = _answer(conn, "decode rate")
        if "error" in first:
            return {**out, "error": first["error"]}
        beside = _timed_steps(trainer, batch, device, steps)
        conn.send("stop")
        second = _answer(conn, "decode rate beside the trainer")
    finally:
        _reap(child)
    if "error" in second:
        return {**out, "error": second["error"]}
    step_slowdown = statistics.median(beside) / statistics.median(alone)
    decode_slowdown = first["alone_steps_per_s"] / max(second["beside_steps_per_s"], 1e-9)
    out.update({
        "trainer_step_s_beside_decode": round(statistics.median(beside), 4),
        "decode_tokens_per_s_alone": round(first["alone_steps_per_s"] * DECODE_BATCH, 1),
        "decode_tokens_per_s_beside_trainer": round(
            second["beside_steps_per_s"] * DECODE_BATCH, 1),
        "step_slowdown": round(step_slowdown, 3), "decode_slowdown": round(decode_slowdown, 3),
        "work_done_together": round(1 / step_slowdown + 1 / decode_slowdown, 3)})
    return out


def contention(ctx: SimpleNamespace) -> dict[str, Any]:
    if not ctx.cuda:
        return {"skipped": "no CUDA"}
    from grpo_nb.llm.config import LLMConfig

    cfg = LLMConfig(model="Qwen/Qwen3-0.6B", dataset="openai/gsm8k", **ctx.gpu_run).resolve()
    out = measure_contention(ctx.shape, ctx.device, cfg)
    torch.cuda.empty_cache()
    return out
