"""``benchmarks/gpu_check.py --probe``: the GPU checks that need neither vLLM nor the Hub.

A GPU machine may have torch and transformers but no vLLM and no ``datasets``, so the probe
and every module it uses must import with torch, transformers and their dependencies alone:
each test here runs in a child Python whose import system refuses ``vllm`` and records the
attempt (a ``try: import vllm`` would otherwise hide it), and refuses the other packages
named as if they were not installed. On this CPU the probe's CUDA checks say they were
skipped and its step check runs on a small Qwen3-shaped model. No server, no GPU.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchmark_modules import benchmark

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"

CUDA_CHECKS = ("device_per_thread", "cuda_ipc", "memory", "contention")

# Run in the child before anything else: every attempt on vLLM is recorded and refused; the
# other packages named cannot be imported (as if not installed: ``import`` raises
# ModuleNotFoundError, ``importlib.util.find_spec`` answers None, as transformers asks).
BLOCK = """
import importlib.abc, json, sys
tried = []
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm":
            tried.append(name)
            raise ModuleNotFoundError("No module named 'vllm' (test)", name="vllm")
sys.meta_path.insert(0, NotInstalled())
for top in BLOCKED:
    sys.modules[top] = None
"""
REPORT_TRIED = """
print("VLLM_TRIED " + json.dumps(tried), file=sys.stderr)
"""
PROBE_SMALL = (f"import runpy; sys.argv = [{str(GPU_CHECK)!r}, '--probe', '--small']\n"
               f"runpy.run_path({str(GPU_CHECK)!r}, run_name='__main__')\n")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _beyond_torch_and_transformers() -> set[str]:
    """Every installed top-level module that no distribution torch and transformers need
    (their requirements, transitively, without extras) provides: what a venv of just those
    two would lack. The project itself and vLLM (refused and recorded by BLOCK) are left out."""
    from packaging.requirements import Requirement

    need, todo = set(), ["torch", "transformers"]
    while todo:
        name = _norm(todo.pop())
        if name in need:
            continue
        need.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, requires)
                 if r.marker is None or r.marker.evaluate({"extra": ""})]
    return {top for top, dists in importlib.metadata.packages_distributions().items()
            if not any(_norm(d) in need for d in dists)} - {"grpo_nb", "vllm"}


def _run_without(blocked: set[str], code: str) -> tuple[str, list[str]]:
    """Run ``code`` in a child Python without the ``blocked`` packages and vLLM, and with no
    CUDA device: (stdout, the vLLM modules it tried to import)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    setup = f"BLOCKED = {sorted(blocked - {'vllm'})!r}\n" + BLOCK
    proc = subprocess.run([sys.executable, "-c", setup + code + REPORT_TRIED], env=env,
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (tried,) = [line for line in proc.stderr.splitlines() if line.startswith("VLLM_TRIED ")]
    return proc.stdout, json.loads(tried.removeprefix("VLLM_TRIED "))


def _report(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout  # one JSON line, nothing else
    return json.loads(lines[0])


def test_probe_runs_without_vllm_and_datasets_and_says_what_ran() -> None:
    """``gpu_check.py --probe --small`` on a CPU with neither vLLM nor ``datasets``: one JSON
    line; the CUDA checks skipped ("no CUDA"); the step check ran: at lr 1e-6 with bf16
    compute the float32 masters keep the update (most elements change), the same model held
    in bf16 rounds it away (few change)."""
    stdout, tried = _run_without({"datasets"}, PROBE_SMALL)
    assert tried == []
    report = _report(stdout)
    assert report["probe"] is True and report["cuda"] is False and report["shape"] == "small"
    assert report["errors"] == {}, report["errors"]
    assert report["ran"] == ["step_changed_frac"]
    assert report["skipped"] == dict.fromkeys(CUDA_CHECKS, "no CUDA")
    for name in CUDA_CHECKS:
        assert report[name] == {"skipped": "no CUDA"}
    step = report["step_changed_frac"]
    assert step["fp32_master"]["step_changed_frac"] >= 0.5, step
    assert step["pure_bf16"]["step_changed_frac"] < 0.1, step
    assert step["fp32_master"]["param_dtype"] == "float32"
    assert step["pure_bf16"]["param_dtype"] == "bfloat16"
    # what a sync would change on a bf16 server: a few elements, the same for both
    assert step["fp32_master"]["sent_changed_frac"] < 0.5, step
    assert step["masters_keep_the_update"] is True


def test_the_probe_and_its_cuda_checks_need_only_torch_and_transformers() -> None:
    """Every installed package that torch and transformers do not need is refused (httpx,
    psutil, datasets, pydantic, …): the probe still runs its step check with no error, and
    every module its CUDA checks use imports, the server settings ``placement`` derives
    included (a CPU run of the probe does not reach them)."""
    blocked = _beyond_torch_and_transformers()
    assert {"datasets", "httpx", "psutil"} <= blocked  # what the project itself installs
    stdout, tried = _run_without(blocked, PROBE_SMALL)
    assert tried == []
    report = _report(stdout)
    assert report["errors"] == {} and report["ran"] == ["step_changed_frac"], report
    assert report["skipped"] == dict.fromkeys(CUDA_CHECKS, "no CUDA")
    stdout, tried = _run_without(
        blocked, f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]\n"
        "import gpu_probe, gpu_probe_procs, gpu_check\n"
        "from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor\n"
        "from grpo_nb.weight_sync.syncer import device_scope\n"
        "from grpo_nb.weight_sync.verify import compare, digest, sent_tensors\n"
        "from grpo_nb.llm import placement\n"
        "from grpo_nb.llm.config import LLMConfig\n"
        "from grpo_nb.llm.policy import PolicyTrainer\n"
        "cfg = LLMConfig(model='Qwen/Qwen3-0.6B', dataset='openai/gsm8k', **gpu_check.GPU_RUN)\n"
        "print(placement.server_config(cfg.model, cfg).max_model_len)\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm')))\n")
    assert tried == []
    assert stdout.split() == ["512", "[]"]


def test_a_missing_package_is_a_skipped_entry_never_a_traceback() -> None:
    """Without transformers the checks that build a model say which package they need; the
    probe still prints its one line, with no error, and the CUDA checks still say "no CUDA"."""
    stdout, tried = _run_without({"transformers", "datasets"}, PROBE_SMALL)
    assert tried == []
    report = _report(stdout)
    assert report["errors"] == {} and report["ran"] == [], report
    assert report["transformers"] == "not installed"
    assert report["skipped"] == {**dict.fromkeys(CUDA_CHECKS, "no CUDA"), "step_changed_frac":
                                 "needs the Python package 'transformers' (not installed)"}


def test_the_probe_model_has_qwen3_0_6b_shape() -> None:
    """The full shape, built on the meta device (no memory): Qwen3-0.6B's model card counts
    0.6B parameters, 0.44B of them outside the embedding, which the head shares (tied)."""
    import torch

    gpu_probe = benchmark("gpu_probe")
    model = gpu_probe.build_model(gpu_probe.QWEN3_06B, torch.device("meta"))
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding
    assert round(total / 1e9, 1) == 0.6 and round((total - embedding.numel()) / 1e9, 2) == 0.44


def _probe_modules() -> tuple[Any, Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # a spawned child imports them from here
    import gpu_probe
    import gpu_probe_procs

    return gpu_probe, gpu_probe_procs


def test_the_ipc_child_answers_from_a_spawned_process() -> None:
    """The IPC check's child, started the way the check starts it (spawn, a pipe), on a CPU:
    it cannot rebuild a CUDA tensor here, and says so over the pipe instead of hanging."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real round trip: gpu_check.py --probe")
    try:
        _, procs = _probe_modules()
        child, conn = procs._spawn(procs._ipc_child, ["x"], [{"GPU-0": (None,) * 15}], 0)
        try:
            reply = procs._answer(conn, "digests")
        finally:
            procs._reap(child)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # the child ran the probe's code, failed where CUDA starts, answered and exited cleanly
    assert set(reply) == {"error"} and "gpu_probe_procs.py" in reply["error"], reply
    assert child.exitcode == 0


def test_contention_measures_both_sides_with_a_decode_child() -> None:
    """The contention check's measurement, on the CPU (the check itself needs CUDA): trainer
    steps timed alone and beside the spawned decode loop, the loop's rate alone and beside
    them, and the child stopped when asked."""
    import torch

    try:
        probe, procs = _probe_modules()
        cfg = probe._step_cfg(torch.device("cpu"), prompts_per_step=2, group_size=2,
                              max_prompt_len=8, max_tokens=8)
        out = procs.measure_contention(probe.SMALL, torch.device("cpu"), cfg, steps=1,
                                       alone_s=1.0)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert "error" not in out, out
    for key in ("trainer_step_s_alone", "trainer_step_s_beside_decode",
                "decode_tokens_per_s_alone", "decode_tokens_per_s_beside_trainer",
                "step_slowdown", "decode_slowdown", "work_done_together"):
        assert out[key] > 0, (key, out)
    assert out["batch"] == "4 sequences x 16 tokens"
