"""Peak memory and time of the trainer's log-prob forward + backward: today's full-logits path
against ``grpo_nb.logprobs`` (chunks of logits from the hidden states, recomputed in backward).

    a Qwen3-0.6B-shaped model (hidden 1024, vocab 151,936, tied head; --layers of them), random
    weights, float32 on the CPU, ``--batch`` x ``--seq`` tokens, the last ``seq - prompt`` of
    each row being the completion (the loss mask)
      old: grpo.token_logprobs(grpo.next_token_logits(...)) + grpo.masked_entropy  (all rows)
      new: grpo.sequence_logprobs_and_entropy(..., mask=mask)      (completion rows only)
      loss: grpo.policy_loss (token-mean, ratio against a perturbed copy of the log-probs)
    ─► one JSON line: per variant the peak memory of one forward + backward (``peak_mib``: the
       process's RSS high-water, ``ru_maxrss``, minus its RSS before the forward; each variant
       runs in a fresh subprocess of its own, so one variant's peak cannot hide the other's;
       torch's CPU allocator returns large blocks to the OS, so RSS follows its tensors) and the
       fastest of ``--repeats`` forward + backward passes; ``peak_ratio`` and ``time_ratio``
       (new / old); ``loss_rel_diff``, ``entropy_rel_diff`` and ``grad_rel_diff`` (the largest,
       over parameters, of max |Δgrad| / max |grad|) between the two.

Run: ``.venv/bin/python benchmarks/logprob_memory.py [--batch 8 --seq 384 --prompt 128
--layers 2 --repeats 2] [--small]`` (full size: ≈ 10 GB of RAM for the old path).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
             max_position_embeddings=4096, rms_norm_eps=1e-6)
SMALL = {**SHAPE, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096}
VARIANTS = ("old", "new")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _build(args: argparse.Namespace) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = SMALL if args.small else SHAPE
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, num_hidden_layers=args.layers)).float()
    model.config.use_cache = False
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g)
    mask = torch.zeros(args.batch, args.seq - 1)
    mask[:, args.prompt - 1:] = 1.0  # position t predicts token t + 1: the completion's tokens
    adv = torch.randn(args.batch, generator=g)
    return model, ids, mask, adv


def _step(variant: str, model: Any, ids: torch.Tensor, mask: torch.Tensor,
          adv: torch.Tensor) -> tuple[float, float]:
    from grpo_nb import grpo

    attn = torch.ones_like(ids)
    if variant == "old":
        logits = grpo.next_token_logits(model, ids, attn)
        logp = grpo.token_logprobs(logits, ids[:, 1:])
        entropy = grpo.masked_entropy(logits, mask)
    else:
        logp, entropy = grpo.sequence_logprobs_and_entropy(model, ids, attn, 1.0, mask=mask)
    g = torch.Generator().manual_seed(2)
    old = logp.detach() + 0.1 * torch.randn(logp.shape, generator=g)
    loss, _ = grpo.policy_loss(logp, old, adv, mask)
    loss.backward()
    return float(loss.detach()), entropy


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: peak RSS and result of one pass, then timed passes."""
    torch.set_num_threads(args.threads)
    model, ids, mask, adv = _build(args)
    before = _rss_mib()
    loss, entropy = _step(args.worker, model, ids, mask, adv)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    torch.save({"loss": loss, "entropy": entropy,
                "grads": {n: p.grad for n, p in model.named_parameters()}}, args.out)
    times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _step(args.worker, model, ids, mask, adv)
        times.append(time.perf_counter() - t0)
    return {"peak_mib": round(peak - before, 1), "rss_before_mib": round(before, 1),
            "time_s": round(min(times), 3), "times_s": [round(t, 3) for t in times]}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=384)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per row (not masked)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--small", action="store_true", help="a reduced shape (seconds)")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 1 <= args.prompt < args.seq:
        p.error(f"need 1 <= --prompt < --seq, got {args.prompt} and {args.seq}")
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    shape = SMALL if args.small else SHAPE
    report: dict[str, Any] = {
        "shape": {"hidden": shape["hidden_size"], "vocab": shape["vocab_size"],
                  "layers": args.layers, "tied": True},
        "tokens": f"{args.batch} x {args.seq}", "masked_frac": round(
            (args.seq - args.prompt) / (args.seq - 1), 3),
        "counter": "ru_maxrss - RSS before the forward, fresh subprocess per variant",
        "threads": args.threads}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in VARIANTS:
            out = Path(tmp) / f"{v}.pt"
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                   "--worker", v, "--out", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"{v} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            report[v] = json.loads(done.stdout.strip().splitlines()[-1])
            results[v] = torch.load(out, weights_only=True)
    old, new = results["old"], results["new"]
    report["peak_ratio"] = round(report["new"]["peak_mib"] / report["old"]["peak_mib"], 3)
    report["time_ratio"] = round(report["new"]["time_s"] / report["old"]["time_s"], 3)
    report["loss_rel_diff"] = abs(new["loss"] - old["loss"]) / max(abs(old["loss"]), 1e-30)
    report["entropy_rel_diff"] = abs(new["entropy"] - old["entropy"]) / old["entropy"]
    report["grad_rel_diff"] = max(_rel(new["grads"][n], g) for n, g in old["grads"].items())
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
