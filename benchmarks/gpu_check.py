"""One prepared GPU check: the trainer side at Qwen3-0.6B size, and weight sync when vLLM is here.

    A (always)   random Qwen3-0.6B-sized model, bf16, gradient checkpointing
                 ─► PolicyTrainer.step on GRPO groups (token_logprobs at a 151,936 vocab,
                    policy_loss, AdamW) ─► peak memory, tokens/s, step time
    B (vLLM)     same model saved ─► vLLM server on GPU 0 ─► WeightSyncer:
                    2+ GPUs: trainer on cuda:1, NCCL engine
                    1 GPU : trainer shares cuda:0, CUDA-IPC engine (NCCL refuses 2 ranks/GPU)
                 ─► train step → sync → verify (probe log-probs) × N ─► sync ms, gap
    ─► prints ONE JSON line: what ran, what did not and why, and the figures

``--dry-run`` runs part A on CPU with a 2-layer model (still the 151k vocabulary) so the code
path is exercised anywhere; part B is then skipped unless ``--with-server`` is given (CPU
server, gloo engine). Budget: < 8 min on one H200.

Run: ``python benchmarks/gpu_check.py`` (GPU) or ``python benchmarks/gpu_check.py --dry-run``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a bare checkout

import torch  # noqa: E402

QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, tie_word_embeddings=True, max_position_embeddings=4096)
DRY = dict(QWEN3_06B, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def build(arch: dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(Qwen3Config(**arch, torch_dtype=str(dtype).split(".")[1])).to(dtype)


def groups(n_prompts: int, group: int, prompt_len: int, completion_len: int, vocab: int,
           seed: int) -> list[Any]:
    from grpo_nb.grpo import group_advantages
    from grpo_nb.serving.rollouts import Group, Rollout

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_prompts):
        rewards = torch.randint(0, 2, (group,), generator=gen).float()
        comps = torch.randint(0, vocab, (group, completion_len), generator=gen).tolist()
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        adv = group_advantages(rewards, group).tolist()
        rollouts = [Rollout(prompt, c, [-12.0] * completion_len, "", "stop", r, a)
                    for c, r, a in zip(comps, rewards.tolist(), adv, strict=True)]
        out.append(Group(i, "", "", prompt, rollouts, 0, 0.0, 0.0))
    return out


def part_a(args: argparse.Namespace, device: str) -> tuple[dict[str, Any], Any, Any]:
    """Trainer side: returns figures, the trainer and the LLM config."""
    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.llm.trainer import PolicyTrainer

    arch = DRY if args.dry_run else QWEN3_06B
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # With 2+ GPUs the trainer takes cuda:1 and leaves cuda:0 to the vLLM server.
    if device == "cuda":
        device = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"
    model = build(arch, device, dtype)
    cfg = LLMConfig(prompts_per_step=args.prompts, group_size=args.group,
                    max_inflight=args.group, grad_accum=args.grad_accum,
                    ratio_against="trainer", tis_cap=2.0)
    pt = PolicyTrainer(model, SimpleNamespace(pad_token_id=0), cfg)
    batch = groups(args.prompts, args.group, args.prompt_len, args.completion_len,
                   arch["vocab_size"], seed=0)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    times = []
    for i in range(args.steps + 1):  # the first step warms up kernels / allocator
        t = time.perf_counter()
        row = pt.step(batch)
        if device != "cpu":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t)
    step_s = sum(times) / len(times)
    tokens = args.prompts * args.group * (args.prompt_len + args.completion_len)
    out = {"params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
           "dtype": str(dtype), "grad_checkpointing": model.is_gradient_checkpointing,
           "batch_seqs": args.prompts * args.group,
           "seq_len": args.prompt_len + args.completion_len, "step_s": round(step_s, 3),
           "tokens_per_s": round(tokens / step_s, 1), "loss_finite": bool(
               torch.isfinite(torch.tensor(row["loss"]))), "grad_norm": round(row["grad_norm"], 4)}
    if device != "cpu":
        out["device"] = device
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return out, pt, cfg


def _save_for_vllm(model: Any, folder: Path) -> None:
    """Model + a tiny word-level tokenizer (vLLM needs one; prompts are token ids anyway)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(folder)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{str(i): 3 + i for i in range(10)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "<unk>")),
                                  pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(folder)


def part_b(args: argparse.Namespace, pt: Any, cfg: Any, device: str) -> dict[str, Any]:
    """vLLM server + weight sync in a train → sync → verify loop."""
    from grpo_nb.serving.server import ServerConfig, VLLMServer
    from grpo_nb.weight_sync import WeightSyncConfig, WeightSyncer

    n_gpu = torch.cuda.device_count()
    transport = "gloo" if device == "cpu" else ("nccl" if n_gpu >= 2 else "ipc")
    # A 151k vocabulary (and bf16 on GPU) widens HF-vs-vLLM log-prob noise: looser tolerance.
    wcfg = WeightSyncConfig(transport=transport, atol=1e-2 if device == "cpu" else 0.15,
                            timeout_s=120)
    out: dict[str, Any] = {"transport": transport, "gpus": n_gpu}
    with tempfile.TemporaryDirectory() as tmp:
        _save_for_vllm(pt.model, Path(tmp))
        scfg = ServerConfig.smoke(tmp) if device == "cpu" else ServerConfig(
            model=tmp, max_model_len=1024, gpu_memory_utilization=0.3, startup_timeout=360)
        for key, value in wcfg.server_settings().items():
            setattr(scfg, key, value)
        scfg.env = {**scfg.env, "CUDA_VISIBLE_DEVICES": "0"} if device != "cpu" else scfg.env
        t = time.perf_counter()
        with VLLMServer(scfg) as server, WeightSyncer(server.url, pt.model, wcfg) as syncer:
            out["server_start_s"] = round(time.perf_counter() - t, 1)
            batch = groups(cfg.prompts_per_step, cfg.group_size, args.prompt_len,
                           args.completion_len, pt.model.config.vocab_size, seed=1)
            ms, gaps = [], []
            for version in range(1, args.syncs + 1):
                pt.step(batch)
                if version == 1:
                    out["gap_before_first_sync"] = round(syncer.weight_gap(), 4)
                res = syncer.sync(version)
                ms.append(res.ms)
                gaps.append(syncer.last_gap)
            out.update(sync_ms=[round(m, 1) for m in ms], sync_mb=round(res.bytes / 1e6, 1),
                       gap_after_sync_max=round(max(gaps), 5), weights_verified=True,
                       served_version=syncer.client.weight_version())
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, 2-layer model (code path only)")
    p.add_argument("--with-server", action="store_true", help="dry run: also part B on CPU")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=384)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--syncs", type=int, default=3)
    args = p.parse_args(argv)
    if args.dry_run:
        args.prompts, args.group, args.prompt_len, args.completion_len = 2, 2, 8, 24
        args.grad_accum, args.steps, args.syncs = 1, 1, 2
    report: dict[str, Any] = {"ran": [], "skipped": {}, "errors": {}}
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        report["skipped"]["all"] = "no CUDA device (use --dry-run to exercise the code on CPU)"
        print(json.dumps(report))
        return report
    report["device"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    report["torch"] = torch.__version__
    t0 = time.perf_counter()
    try:
        report["trainer"], pt, cfg = part_a(args, device)
        report["ran"].append("trainer")
    except Exception as err:
        report["errors"]["trainer"] = f"{err!r}\n{traceback.format_exc()[-1500:]}"
        pt = None
    if importlib.util.find_spec("vllm") is None:
        report["skipped"]["vllm"] = "vLLM is not installed: server + weight sync not run"
    elif device == "cpu" and not args.with_server:
        report["skipped"]["vllm"] = "dry run without --with-server"
    elif pt is not None:
        try:
            report["vllm"] = part_b(args, pt, cfg, device)
            report["ran"].append("vllm+" + report["vllm"]["transport"])
        except Exception as err:
            report["errors"]["vllm"] = f"{err!r}\n{traceback.format_exc()[-1500:]}"
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
