"""``benchmarks/gpu_check.py``'s report, assembled from metric rows without a run: a metrics file
written here with known figures, and notebook 05's recorded async run; the memory sampler on
this machine's own processes; checkpoints skipped unless asked. No server, no GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "notebooks" / "recorded" / "nb05-async"


@pytest.fixture(scope="module")
def report_modules():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
        import gpu_report

        yield gpu_check, gpu_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _run_folder(tmp_path: Path) -> Path:
    """A run's folder as ``train`` leaves it: three steps (the first: warm-up), a sync, an
    evaluation and a checkpoint between steps 2 and 3, the generators' and trainer's busy rows."""
    from grpo_nb.metrics import MetricsRecorder

    rec = MetricsRecorder(tmp_path)
    rec.log("data", train=10, test=2, prompt_example="1+1=")
    for step, t, tokens, tis, capped in ((1, 10.0, 100, 1.0, {"tis_capped_frac": 0.5}),
                                         (2, 20.0, 200, 0.98, {"tis_frac_capped": 0.1}),
                                         (3, 40.0, 300, 1.02, {"tis_capped_frac": 0.0})):
        rec.log("step", t=t, step=step, tokens=tokens, tis_weight_mean=tis, train_s=2.0 * step,
                step_changed_frac=0.9, sent_changed_frac=0.3, truncated_frac=0.25 * step,
                **capped)
    rec.log("sync", t=21.0, step=2, version=2, ms=500.0, verified=True,
            phases={"transfer": 300.0, "version": 5.0})
    for actor, label, start, end in (("trainer", "train", 14.0, 20.0), ("trainer", "sync", 20.0,
                                     21.0), ("trainer", "eval", 25.0, 30.0),
                                     ("trainer", "checkpoint", 32.0, 34.0),
                                     ("gen0", "generate", 5.0, 15.0),
                                     ("gen1", "generate", 12.0, 18.0)):
        rec.log("busy", t=end, actor=actor, label=label, start=start, end=end)
    rec.close()
    (tmp_path / "result.json").write_text(json.dumps({"prompt_example": "1+1="}))
    return tmp_path


def test_the_report_reads_what_a_first_gpu_run_must_show(report_modules, tmp_path) -> None:
    """Agreement (either key of the capped fraction), changes, truncation; throughput over the
    steady steps only (steps 2 and 3: 500 tokens over 30 s less the 7 s of evaluation and
    checkpoint), not over the wall; time per phase."""
    gpu_check, _ = report_modules
    result = SimpleNamespace(steps=3, weights_verified=True, tokens_per_s=5.0, sync_ms_mean=500.0,
                             wall_s=120.0, accuracy_before=0.1, accuracy_after=0.2,
                             stale_dropped=0)
    report = gpu_check.figures(result, _run_folder(tmp_path))
    assert report["tis_weight_mean"] == 1.0 and report["tis_weight_range"] == [0.98, 1.02]
    assert report["tis_capped_frac"] == pytest.approx(0.2)  # both keys: (0.5 + 0.1 + 0) / 3
    assert (report["step_changed_frac"], report["sent_changed_frac"]) == (0.9, 0.3)
    assert report["truncated_frac"] == 0.5
    throughput = report["throughput"]
    assert throughput["gen_tokens_per_s"] == pytest.approx(500 / 23, abs=0.1), throughput
    assert throughput["steady_steps"] == 2 and throughput["paused_s"] == 7.0
    phases = report["phases"]
    assert phases["trainer_s"] == {"checkpoint": 2.0, "eval": 5.0, "sync": 1.0, "train": 6.0}
    assert phases["generators_busy_s"] == 13.0  # 5–18 s: the two overlap
    assert phases["step_train_s_mean"] == 5.0  # the steady steps' (4 s, 6 s)
    assert phases["trainer_wait_s"] == 30.0 - 6.0 - 1.0 - 5.0 - 2.0  # 10–40 s less all it did
    assert phases["sync_phases_ms_mean"] == {"transfer": 300.0, "version": 5.0}
    assert report["tokens_per_s"] == 5.0 and report["weights_verified"] is True


def test_the_recorded_async_run_gives_its_steady_throughput(report_modules) -> None:
    """Notebook 05's recorded async run: 99 steady steps; its evaluations inside the span are
    left out, so the steady rate is above tokens over the span."""
    from grpo_nb.metrics import load_metrics

    _, gpu_report = report_modules
    rows = load_metrics(RECORDED).rows()
    figures = gpu_report.figures(rows)
    steps = [r for r in rows if r["kind"] == "step"]
    throughput = figures["throughput"]
    span = steps[-1]["t"] - steps[0]["t"]
    tokens = sum(r["tokens"] for r in steps[1:])
    assert throughput["steady_steps"] == 99 and throughput["steady_tokens"] == tokens
    assert throughput["paused_s"] > 0  # evaluations at steps 25, 50, 75
    assert throughput["gen_tokens_per_s"] > tokens / span
    assert figures["tis_weight_mean"] is not None and figures["tis_capped_frac"] is None
    assert 0 < figures["sent_changed_frac"] <= figures["step_changed_frac"] <= 1


def test_memory_is_sampled_for_the_server_tree_and_the_trainer(report_modules) -> None:
    """A stand-in server (a process and its child) and this process as the trainer: each side's
    peak resident set; GPU memory says why it cannot be read here."""
    _, gpu_report = report_modules
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
            "'import time; x = bytearray(64 << 20); time.sleep(30)']); time.sleep(30)"
    server = subprocess.Popen([sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 60
        while len(gpu_report.process_tree(server.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # the grandchild's 64 MiB, touched
        with gpu_report.MemorySampler(server.pid, every_s=0.1) as memory:
            time.sleep(0.3)
    finally:
        for pid in gpu_report.process_tree(server.pid)[::-1]:
            subprocess.run(["kill", str(pid)], check=False)
        server.wait(10)
    report = memory.report({"peak_gpu_reserved_gib": {0: 1.5}})
    assert len(report["server"]["pids"]) == 2 and report["server"]["peak_rss_gib"] > 0.06
    assert report["trainer"]["pids"] == [__import__("os").getpid()]
    assert report["trainer"]["peak_rss_gib"] > 0
    assert report["trainer"]["peak_gpu_reserved_gib"] == {0: 1.5}
    if not gpu_report.shutil.which("nvidia-smi"):
        assert report["server"]["peak_gpu_gib"] == "nvidia-smi not found"


def test_no_checkpoint_is_written_unless_asked(report_modules, tmp_path) -> None:
    """The run's end-of-run checkpoint (model + AdamW state: ≈ 7 GB at 0.6B) is skipped by
    default, written with ``--checkpoints``; under Monarch the report says it is written."""
    from grpo_nb.llm.policy import PolicyTrainer

    gpu_check, _ = report_modules
    save = PolicyTrainer.save
    with gpu_check.checkpoints(Namespace(checkpoints=False, backend="asyncio")) as said:
        assert PolicyTrainer.save(None, tmp_path / "ckpt") == tmp_path / "ckpt"
    assert said.startswith("skipped") and not (tmp_path / "ckpt").exists()
    assert PolicyTrainer.save is save
    with gpu_check.checkpoints(Namespace(checkpoints=True, backend="asyncio")) as said:
        assert PolicyTrainer.save is save and said.startswith("written")
    with gpu_check.checkpoints(Namespace(checkpoints=False, backend="monarch")) as said:
        assert PolicyTrainer.save is save and "monarch" in said
    cfg = gpu_check.config(Namespace(dry_run=True, steps=2), "Qwen/Qwen3-0.6B", "openai/gsm8k")
    assert cfg.checkpoint_every > cfg.steps  # none during the run either
