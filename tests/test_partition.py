"""The CPU partition: the plan, pinning every thread of the trainer's process, and a started
vLLM server whose whole process tree (every process, every thread) runs on the planned cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_nb import partition
from grpo_nb.partition import Plan, format_cpus, parse_cpus, plan


def allowed_list(pid: int | str, tid: int | str) -> tuple[int, ...]:
    """``Cpus_allowed_list`` of one thread of a process, from ``/proc``."""
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpus(line.split(":", 1)[1].strip())
    raise RuntimeError(f"/proc/{pid}/task/{tid}/status: no Cpus_allowed_list")


def test_default_plan_puts_the_server_on_the_last_core_off_on_gpu_or_one_core(monkeypatch):
    monkeypatch.delenv(partition.ENV, raising=False)
    assert plan(2, gpu=False) == Plan((1,), (0,), 1, "auto: the last of 2 cores")
    p = plan([0, 1, 2, 3], gpu=False)
    assert (p.server_cpus, p.trainer_cpus, p.trainer_threads) == ((3,), (0, 1, 2), 3)
    assert not plan(4, gpu=True).active
    assert not plan(1, gpu=False).active
    assert "core(s) 3" in p.describe() and plan(1, gpu=False).describe().startswith("off")


def test_plan_is_configurable_by_argument_and_environment(monkeypatch):
    p = plan(4, server_cpus="2-3", gpu=False)
    assert (p.server_cpus, p.trainer_cpus, p.trainer_threads) == ((2, 3), (0, 1), 2)
    assert plan(4, server_cpus=[0], gpu=True).server_cpus == (0,)  # explicit wins on GPU too
    monkeypatch.setenv(partition.ENV, "off")
    assert not plan(4, gpu=False).active
    monkeypatch.setenv(partition.ENV, "0")
    assert plan(2, gpu=False).trainer_cpus == (1,)


@pytest.mark.parametrize(("spec", "message"), [
    ("x", "server_cpus='x'"), ("0-1", "takes every core"), ("7", "not among"),
    ([-1], "core ids ≥ 0")])
def test_bad_server_cpus_name_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        plan(2, server_cpus=spec, gpu=False)


def test_bad_server_config_cpus_names_the_field():
    from grpo_nb.serving.server import ServerConfig

    with pytest.raises(ValueError, match="ServerConfig.cpus"):
        ServerConfig(model="m", cpus="one")


def test_cpu_lists_round_trip():
    assert parse_cpus("0,2-3,5") == (0, 2, 3, 5)
    assert format_cpus((5, 0, 2, 3)) == "0,2-3,5"


def test_apply_pins_every_thread_and_torch_then_restores():
    """In a child: threads that exist before ``pinned()`` must move too (a plain
    ``sched_setaffinity(0)`` moves only the caller), and all must come back after."""
    code = textwrap.dedent("""
        import json, os, threading, torch
        from grpo_nb import partition
        torch.set_num_threads(2)
        stop = threading.Event()
        t = threading.Thread(target=stop.wait); t.start()
        mine = partition.available_cpus()
        p = partition.Plan(mine[-1:], mine[:1], 1, "test")
        def masks():
            return {next(line.split()[1] for line in open(f"/proc/self/task/{tid}/status")
                         if line.startswith("Cpus_allowed_list:"))
                    for tid in os.listdir("/proc/self/task")}
        with partition.pinned(p):
            inside, threads = masks(), torch.get_num_threads()
        after = masks()
        stop.set(); t.join()
        print(json.dumps([sorted(inside), threads, sorted(after), torch.get_num_threads()]))
    """)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    mine = list(partition.available_cpus())
    assert json.loads(out.splitlines()[-1]) == [[format_cpus(mine[:1])], 1, [format_cpus(mine)], 2]


@pytest.mark.vllm
def test_started_server_tree_runs_on_the_planned_cores(vllm_server):
    """Every process and thread of the session's server (started with ``cpus="auto"``) has
    the planned mask (Cpus_allowed_list), while this test process keeps all its cores."""
    server = vllm_server
    mine = partition.available_cpus()
    if len(mine) < 2:
        pytest.skip("needs 2 cores")
    want = (mine[-1],)  # the default plan on a CPU-only machine: the server on the last core
    assert server.cpus == want and server.healthy()
    pids = server.pids()
    assert len(pids) >= 2, f"expected the API server and its EngineCore, got {pids}"
    masks = {(pid, tid): allowed_list(pid, tid)
             for pid in pids for tid in os.listdir(f"/proc/{pid}/task")}
    wrong = {k: v for k, v in masks.items() if v != want}
    assert not wrong, f"threads off the planned cores {want}: {wrong}"
    with open(f"/proc/{server.proc.pid}/environ", "rb") as f:
        env = f.read().split(b"\0")
    assert f"VLLM_CPU_OMP_THREADS_BIND={format_cpus(want)}".encode() in env
    assert partition.available_cpus() == mine


def test_a_pinned_tree_inherits_the_mask_and_the_starting_thread_keeps_its_own(monkeypatch,
                                                                               tmp_path):
    """No vLLM: a stand-in tree (a parent that starts a child) started with one core."""
    import time

    from grpo_nb.serving import server as serving

    mine = partition.available_cpus()
    if len(mine) < 2:
        pytest.skip("needs 2 cores")
    tree = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)")
    monkeypatch.setattr(serving.ServerConfig, "command",
                        lambda self, port, gpu: [sys.executable, "-c", tree])
    monkeypatch.setattr(serving.VLLMServer, "healthy", lambda self: True)
    monkeypatch.setattr(serving, "_LIVE", set())
    cfg = serving.ServerConfig(model="fake", log_dir=tmp_path, cpus=[mine[-1]])
    with serving.VLLMServer(cfg).start(progress=False) as server:
        deadline = time.monotonic() + 20
        while len(server.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(server.pids()) == 2
        assert {allowed_list(pid, pid) for pid in server.pids()} == {(mine[-1],)}
        assert partition.available_cpus() == mine


# ── the LLM ring's trainer side (no vLLM: a stand-in server that only has .cpus) ──


def test_beside_gives_the_trainer_the_cores_the_server_leaves():
    mine = partition.available_cpus()
    if len(mine) < 2:
        pytest.skip("needs 2 cores")
    p = partition.beside([mine[-1]])
    assert (p.server_cpus, p.trainer_cpus, p.trainer_threads) == ((mine[-1],), mine[:-1],
                                                                  len(mine) - 1)
    assert not partition.beside(None).active and not partition.beside(mine).active


def test_llm_ring_pins_this_process_during_the_run_and_restores_it_even_on_error():
    """What :func:`grpo_nb.llm.run.run_ring` wraps the ring in: the trainer's cores (beside
    the server tree's) and the trainer's torch threads (``trainer_threads``, stated by the plan)
    during, everything as before after, also when the run raises; no pinning for an unpinned
    server ("off") or a trainer of its own, whose plans still state the trainer's threads."""
    from types import SimpleNamespace

    import torch

    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.llm.run import trainer_cores

    mine = partition.available_cpus()
    if len(mine) < 2:
        pytest.skip("needs 2 cores")
    cfg, server = LLMConfig(device="cpu", trainer_threads=3), SimpleNamespace(cpus=(mine[-1],))

    def run(fail: bool) -> None:
        with trainer_cores(cfg, server, "asyncio") as p:
            assert p.active and partition.available_cpus() == mine[:-1]
            assert torch.get_num_threads() == p.trainer_threads == 3  # the threads it states
            assert "with 3 torch thread(s)" in p.describe()
            if fail:
                raise RuntimeError("the run failed")

    threads = torch.get_num_threads()
    torch.set_num_threads(len(mine) + 1)  # not what the plan sets: restoring it shows
    try:
        run(False)
        assert partition.available_cpus() == mine and torch.get_num_threads() == len(mine) + 1
        with pytest.raises(RuntimeError, match="the run failed"):
            run(True)
        assert partition.available_cpus() == mine and torch.get_num_threads() == len(mine) + 1
    finally:
        torch.set_num_threads(threads)
    for srv, backend in ((SimpleNamespace(cpus=None), "asyncio"), (server, "monarch"),
                         (object(), "asyncio")):
        with trainer_cores(cfg, srv, backend) as p:
            assert not p.active and partition.available_cpus() == mine
            assert p.describe().endswith("; trainer with 3 torch thread(s)"), p.describe()
