"""``gpu_check.py --probe``: the parts of the GPU path that need neither vLLM nor the Hub.

A GPU machine may have torch and transformers but no vLLM, no ``datasets`` and no network.
These checks import only torch, transformers and the project's modules that need nothing
else (a test runs them with every other installed package blocked), build their model from
a config (random weights) and print ONE JSON line::

    device_per_thread  two threads at once: one under weight_sync.syncer.device_scope of
                       the trainer's device (the last GPU), one without; which device each
                       sees (torch.cuda.current_device, and where a bare "cuda" tensor lands)
    cuda_ipc           ~300 tensors sent as the syncer sends them over CUDA IPC, rebuilt and
                       digested in a spawned child (gpu_probe_procs)
    step_changed_frac  one GRPO step of PolicyTrainer at lr 1e-6 with bf16 compute, on a
                       random-weight model of Qwen3-0.6B's shape: float32 masters (the
                       trainer as it is) and the same model held in bf16 (pure-bf16 AdamW,
                       the baseline it must beat)
    memory             the server's gpu_memory_utilization (placement.server_config) held as
                       one allocation on the trainer's GPU when the two share it, then two
                       training steps (AdamW's state appears in the first opt.step(), after
                       step 1's peak) at the GPU run's batch and at the CLI default's: per
                       step its time, peak allocated and reserved memory; whether both fit
    contention         trainer steps alone and beside a decode-like loop in a second process
                       on the same GPU (gpu_probe_procs)

A check that needs CUDA reports ``{"skipped": "no CUDA"}`` without one, a check that needs a
package this machine lacks ``{"skipped": "needs the Python package ..."}``; the line's
``ran`` and ``skipped`` name which ran, ``errors`` what failed. ``small=True`` uses a
reduced shape (a CPU-sized model).
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import math
import threading
import time
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.llm.data import Group
    from grpo_nb.llm.policy import PolicyTrainer

# Qwen/Qwen3-0.6B's config.json (the fields that decide memory and compute).
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6)
SMALL = {**QWEN3_06B, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "vocab_size": 1024}
LR = 1e-6  # the GPU run's lr: an update far below a bf16 step at the weights' magnitude
MEMORY_STEPS = 2  # AdamW's state is allocated in the first opt.step(), after step 1's peak
OWN_MODULES = ("grpo_nb", "gpu_probe", "gpu_probe_procs", "vllm")  # missing: an error


def build_model(shape: dict[str, Any], device: torch.device) -> Any:
    """A float32 Qwen3 of ``shape`` with random weights (seeded), built on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(Qwen3Config(**shape)).float()


def groups(cfg: LLMConfig, vocab: int, prompt_len: int, completion_len: int) -> list[Group]:
    """``cfg.prompts_per_step`` groups of random tokens, rewards alternating 1, 0 (so every
    advantage is ±1). The sampler's log-probs are the uniform distribution's, near a
    random-weight model's own, so the truncated importance weight is about 1."""
    from grpo_nb.grpo import group_advantages
    from grpo_nb.llm.data import Group, Rollout

    gen = torch.Generator().manual_seed(1)
    uniform = -math.log(vocab)
    out = []
    for g in range(cfg.prompts_per_step):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        rewards = [float(i % 2 == 0) for i in range(cfg.group_size)]
        adv = group_advantages(torch.tensor(rewards), cfg.group_size).tolist()
        rollouts = []
        for r, a in zip(rewards, adv, strict=True):
            completion = torch.randint(0, vocab, (completion_len,), generator=gen).tolist()
            rollouts.append(Rollout(completion, [uniform] * completion_len, "", "length", r, a))
        out.append(Group(g, "", "", prompt, rollouts, 0, 0.0, 0.0))
    return out


def _trainer(shape: dict[str, Any], device: torch.device, cfg: LLMConfig) -> PolicyTrainer:
    from grpo_nb.llm.policy import PolicyTrainer

    tokenizer = SimpleNamespace(pad_token_id=0)  # make_batch needs only the pad id
    return PolicyTrainer(build_model(shape, device), tokenizer, cfg)


# ── the checks: each returns a dict, {"skipped": why} when it cannot run here ──


def device_per_thread(ctx: SimpleNamespace) -> dict[str, Any]:
    if not ctx.cuda:
        return {"skipped": "no CUDA"}
    from grpo_nb.weight_sync.syncer import device_scope

    target = torch.device(f"cuda:{torch.cuda.device_count() - 1}")  # placement's trainer GPU
    seen: dict[str, Any] = {}
    both_inside = threading.Barrier(2, timeout=60)

    def look(name: str) -> None:
        seen[name] = {"current_device": torch.cuda.current_device(),
                      "bare_cuda_tensor": torch.empty(1, device="cuda").device.index}

    def scoped() -> None:
        with device_scope(target):
            both_inside.wait()  # the other thread looks while this one holds the scope
            look("scoped")
            both_inside.wait()
        look("scoped_after_exit")

    def unscoped() -> None:
        both_inside.wait()
        look("unscoped")
        both_inside.wait()

    errors: list[str] = []

    def run(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as err:  # reported in the line (a broken barrier: the other failed)
            errors.append(repr(err))

    threads = [threading.Thread(target=run, args=(f,)) for f in (scoped, unscoped)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    out: dict[str, Any] = {"gpus": torch.cuda.device_count(), "scope": str(target), **seen}
    if errors:
        out["thread_errors"] = errors
    out["scope_holds"] = all(seen.get("scoped", {}).get(k) == target.index
                             for k in ("current_device", "bare_cuda_tensor"))
    out["scope_restored"] = seen.get("scoped_after_exit", {}).get("current_device") == 0
    if torch.cuda.device_count() >= 2:
        out["other_thread_unaffected"] = seen.get("unscoped", {}).get("current_device") == 0
    else:
        out["other_thread_unaffected"] = "not tested: one GPU (the scope is the default device)"
    return out


def _step_cfg(device: torch.device, **sizes: Any) -> LLMConfig:
    from grpo_nb.llm.config import LLMConfig

    return LLMConfig(device=device.type, dtype="bfloat16", lr=LR, **sizes).resolve()


def step_changed(ctx: SimpleNamespace) -> dict[str, Any]:
    """``step_changed_frac`` of one bf16-compute step: float32 masters vs pure bf16."""
    cfg = _step_cfg(ctx.device, prompts_per_step=2, group_size=2, max_prompt_len=16,
                    max_tokens=16)
    batch = groups(cfg, ctx.shape["vocab_size"], 12, 12)
    out: dict[str, Any] = {"device": str(ctx.device), "lr": LR}
    for mode in ("fp32_master", "pure_bf16"):
        pt = _trainer(ctx.shape, ctx.device, cfg)
        if mode == "pure_bf16":
            # Module.to keeps the Parameter objects: AdamW and the meter watch the bf16 ones
            pt.model.to(torch.bfloat16)
        row = pt.step(batch)
        out[mode] = {k: row.get(k) for k in ("step_changed_frac", "sent_changed_frac",
                                             "grad_norm", "skipped")
                     if row.get(k) is not None}
        out[mode]["param_dtype"] = str(next(pt.model.parameters()).dtype).removeprefix("torch.")
        del pt
        if ctx.cuda:
            torch.cuda.empty_cache()
    out["masters_keep_the_update"] = (
        out["fp32_master"].get("step_changed_frac", 0.0) >= 0.5
        and out["pure_bf16"].get("step_changed_frac", 1.0) < 0.1)
    return out


def _memory_steps(ctx: SimpleNamespace, cfg: LLMConfig, device: torch.device,
                  held_bytes: int) -> dict[str, Any]:
    """``MEMORY_STEPS`` training steps at ``cfg``'s batch beside ``held_bytes`` already held."""
    out: dict[str, Any] = {"batch": f"{cfg.batch_size} sequences x {cfg.context_len} tokens "
                                    f"(grad_accum {cfg.grad_accum})", "steps": []}
    pt = None
    try:
        pt = _trainer(ctx.shape, device, cfg)
        batch = groups(cfg, ctx.shape["vocab_size"], cfg.max_prompt_len, cfg.max_tokens)
        for _ in range(MEMORY_STEPS):
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            row = pt.step(batch)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            out["steps"].append({
                "step_s": round(time.perf_counter() - t0, 3),
                "trainer_peak_gib": round((peak - held_bytes) / 2**30, 2),
                "peak_allocated_gib": round(peak / 2**30, 2),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
                "step_changed_frac": row.get("step_changed_frac")})
        out["fits"] = True
        # what the device itself has left (CUDA contexts and other processes included)
        out["device_free_after_gib"] = round(torch.cuda.mem_get_info(device)[0] / 2**30, 2)
    except torch.OutOfMemoryError as err:
        out["fits"] = False
        out["oom_in_step"] = len(out["steps"]) + 1
        out["oom"] = str(err)[:500]
    del pt
    gc.collect()  # the next batch starts from an empty trainer
    torch.cuda.empty_cache()
    return out


def memory(ctx: SimpleNamespace) -> dict[str, Any]:
    """Two training steps at the GPU run's batch and at the CLI default's (``python -m
    grpo_nb train --model Qwen/Qwen3-0.6B --dataset openai/gsm8k``), with the server's
    share of the GPU held."""
    if not ctx.cuda:
        return {"skipped": "no CUDA"}
    from grpo_nb.llm import placement
    from grpo_nb.llm.config import LLMConfig

    runs = {"gpu_run": ctx.gpu_run, "cli_default": {}}
    cfg = LLMConfig(model="Qwen/Qwen3-0.6B", dataset="openai/gsm8k", **ctx.gpu_run).resolve()
    device = torch.device(placement.trainer_device(cfg))
    fraction = placement.server_config(cfg.model, cfg).gpu_memory_utilization
    shared = placement.gpu_count() < 2  # else the server has a GPU of its own
    total = torch.cuda.get_device_properties(device).total_memory
    held_bytes = int(fraction * total) if shared else 0
    out: dict[str, Any] = {
        "device": str(device), "total_gib": round(total / 2**30, 2),
        "server_fraction": fraction, "server_shares_this_gpu": shared,
        "held_gib": round(held_bytes / 2**30, 2), "dtype": placement.dtype_of(cfg)}
    held = torch.empty(held_bytes, dtype=torch.uint8, device=device)
    try:
        for name, sizes in runs.items():
            run_cfg = LLMConfig(model="Qwen/Qwen3-0.6B", dataset="openai/gsm8k", **sizes).resolve()
            out[name] = _memory_steps(ctx, run_cfg, device, held_bytes)
    finally:
        del held
        torch.cuda.empty_cache()
    out["fits"] = all(out[name]["fits"] for name in runs)
    return out


def _checks() -> dict[str, Callable[[SimpleNamespace], dict[str, Any]]]:
    from gpu_probe_procs import contention, cuda_ipc

    return {"device_per_thread": device_per_thread, "cuda_ipc": cuda_ipc,
            "step_changed_frac": step_changed, "memory": memory, "contention": contention}


def _version(package: str) -> str:
    """``package``'s version, without importing it; "not installed" when it cannot be."""
    try:
        if importlib.util.find_spec(package) is not None:
            return importlib.metadata.version(package)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        pass
    return "not installed"


def probe(small: bool, gpu_run: dict[str, Any]) -> dict[str, Any]:
    """Every check, in order; the report names which ran, which were skipped and why, and
    the errors (a check that raised, or that lacks vLLM or a module of this project)."""
    cuda = torch.cuda.is_available()
    # the trainer's GPU as placement picks it: the last (the server takes the first)
    ctx = SimpleNamespace(cuda=cuda, shape=SMALL if small else QWEN3_06B, gpu_run=gpu_run,
                          device=torch.device(f"cuda:{torch.cuda.device_count() - 1}")
                          if cuda else torch.device("cpu"))
    report: dict[str, Any] = {
        "probe": True, "shape": "small" if small else "Qwen3-0.6B", "cuda": cuda,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "hardware": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__, "transformers": _version("transformers"),
        "ran": [], "skipped": {}, "errors": {}}
    t0 = time.perf_counter()
    for name, check in _checks().items():
        try:
            result = check(ctx)
        except Exception as err:
            missing = (err.name or "") if isinstance(err, ModuleNotFoundError) else ""
            if not missing or missing.split(".")[0] in OWN_MODULES:
                report["errors"][name] = f"{err!r}\n{traceback.format_exc()[-2000:]}"
                continue
            result = {"skipped": f"needs the Python package {missing!r} (not installed)"}
        report[name] = result
        if "skipped" in result:
            report["skipped"][name] = result["skipped"]
        else:
            report["ran"].append(name)
    report["check_s"] = round(time.perf_counter() - t0, 1)
    return report
