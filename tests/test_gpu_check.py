"""``benchmarks/gpu_check.py --probe``: the GPU checks that need neither vLLM nor the Hub.

A GPU machine may have torch and transformers but no vLLM, so the probe and every module it
uses must import without vLLM: each test here runs in a child Python whose import system
refuses ``vllm`` and records the attempt (a ``try: import vllm`` would otherwise hide it).
On this CPU the probe's CUDA checks say they were skipped and its step check runs on a
small Qwen3-shaped model. No server, no GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"

# Run in the child before anything else: the packages named cannot be imported (as if not
# installed), and every attempt on vLLM is recorded.
BLOCK = """
import importlib.abc, json, sys
tried = []
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top == "vllm":
            tried.append(name)
        if top in BLOCKED:
            raise ModuleNotFoundError(f"No module named {top!r} (test)", name=top)
sys.meta_path.insert(0, NotInstalled())
"""
REPORT_TRIED = """
print("VLLM_TRIED " + json.dumps(tried), file=sys.stderr)
"""
PROBE_SMALL = (f"import runpy; sys.argv = [{str(GPU_CHECK)!r}, '--probe', '--small']\n"
               f"runpy.run_path({str(GPU_CHECK)!r}, run_name='__main__')\n")


def _run_without(blocked: set[str], code: str) -> tuple[str, list[str]]:
    """Run ``code`` in a child Python without the ``blocked`` packages (vLLM always) and
    with no CUDA device: (stdout, the vLLM modules it tried to import)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    setup = f"BLOCKED = {sorted(blocked | {'vllm'})!r}\n" + BLOCK
    proc = subprocess.run([sys.executable, "-c", setup + code + REPORT_TRIED], env=env,
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (tried,) = [line for line in proc.stderr.splitlines() if line.startswith("VLLM_TRIED ")]
    return proc.stdout, json.loads(tried.removeprefix("VLLM_TRIED "))


def _report(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout  # one JSON line, nothing else
    return json.loads(lines[0])


def test_probe_runs_without_vllm_and_says_what_ran() -> None:
    """``--probe --small`` on a CPU: one JSON line; the CUDA checks skipped ("no CUDA"); the
    step check ran: at lr 1e-6 with bf16 compute the float32 masters keep the update (most
    elements change), the same model held in bf16 rounds it away (few change)."""
    stdout, tried = _run_without(set(), PROBE_SMALL)
    assert tried == []
    report = _report(stdout)
    assert report["probe"] is True and report["cuda"] is False and report["shape"] == "small"
    assert report["errors"] == {}, report["errors"]
    assert report["ran"] == ["step_changed_frac"]
    cuda_checks = ("device_per_thread", "cuda_ipc", "memory")
    assert report["skipped"] == dict.fromkeys(cuda_checks, "no CUDA")
    for name in cuda_checks:
        assert report[name] == {"skipped": "no CUDA"}
    step = report["step_changed_frac"]
    assert step["fp32_master"]["step_changed_frac"] >= 0.5, step
    assert step["pure_bf16"]["step_changed_frac"] < 0.1, step
    assert step["fp32_master"]["param_dtype"] == "float32"
    assert step["pure_bf16"]["param_dtype"] == "bfloat16"
    # what a sync would change on a bf16 server: a few elements, the same for both
    assert step["fp32_master"]["sent_changed_frac"] < 0.5, step
    assert step["masters_keep_the_update"] is True


def test_every_module_the_gpu_checks_use_imports_without_vllm() -> None:
    """The CUDA checks' imports, which a CPU run of the probe does not reach: the probe
    module, the IPC reductions, and the server settings ``placement`` derives (its server
    module is imported inside the function)."""
    stdout, tried = _run_without(
        set(), f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]\n"
        "import gpu_probe, gpu_check\n"
        "from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor\n"
        "from grpo_nb.llm import placement\n"
        "from grpo_nb.llm.config import LLMConfig\n"
        "cfg = LLMConfig(model='Qwen/Qwen3-0.6B', dataset='openai/gsm8k', **gpu_check.GPU_RUN)\n"
        "print(placement.server_config(cfg.model, cfg).max_model_len)\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm')))\n")
    assert tried == []
    assert stdout.split() == ["512", "[]"]


def test_a_missing_package_skips_only_the_checks_that_need_it() -> None:
    """A GPU machine without ``datasets`` (the trainer's modules import it): the step check
    says which package it needs; the probe still prints its line, with no error."""
    stdout, tried = _run_without({"datasets"}, PROBE_SMALL)
    assert tried == []
    report = _report(stdout)
    assert report["errors"] == {} and report["ran"] == [], report
    assert report["skipped"]["step_changed_frac"] == (
        "needs the Python package 'datasets' (not installed)")
    assert report["skipped"]["cuda_ipc"] == "no CUDA"


def test_the_probe_model_has_qwen3_0_6b_shape() -> None:
    """The full shape, built on the meta device (no memory): Qwen3-0.6B's model card counts
    0.6B parameters, 0.44B of them outside the embedding, which the head shares (tied)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_probe
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    model = gpu_probe.build_model(gpu_probe.QWEN3_06B, torch.device("meta"))
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding
    assert round(total / 1e9, 1) == 0.6 and round((total - embedding.numel()) / 1e9, 2) == 0.44


def test_the_ipc_child_answers_from_a_spawned_process() -> None:
    """The IPC check's child, started the way the check starts it (spawn, a pipe), on a CPU:
    it cannot rebuild a CUDA tensor here, and says so over the pipe instead of hanging."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real round trip: gpu_check.py --probe")
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the child imports the module from here
    try:
        import gpu_probe

        mp = torch.multiprocessing.get_context("spawn")
        ours, theirs = mp.Pipe()
        child = mp.Process(target=gpu_probe._ipc_child, args=((None,) * 15, 0, theirs),
                           daemon=True)
        child.start()
        try:
            assert ours.poll(gpu_probe.CHILD_TIMEOUT_S), "no answer from the child"
            reply = ours.recv()
        finally:
            child.join(timeout=30)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # the child ran the probe's code, failed where CUDA starts, answered and exited cleanly
    assert set(reply) == {"error"} and "gpu_probe.py" in reply["error"], reply
    assert child.exitcode == 0
