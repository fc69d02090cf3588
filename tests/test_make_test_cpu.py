"""``benchmarks/make_test_cpu.py``: how it sorts processes into kinds, and a real run of a
command whose CPU time is known."""

from __future__ import annotations

import json
import sys

from benchmark_modules import benchmark


def _module():
    return benchmark("make_test_cpu")


def test_a_servers_whole_tree_counts_as_the_server_and_the_rest_by_command() -> None:
    m = _module()
    py = "/repo/.venv/bin/python"
    procs = [m.Proc(10, 1, f"{py} .venv/bin/pytest -q tests"),
             m.Proc(11, 10, f"{py} -m vllm.entrypoints.openai.api_server --model tiny"),
             m.Proc(12, 11, "VLLM::EngineCore"),
             m.Proc(13, 12, f"{py} -c from multiprocessing.spawn import spawn_main"),
             m.Proc(14, 10, f"{py} -m grpo_nb train --smoke"),
             m.Proc(15, 14, f"{py} -c from multiprocessing.spawn import spawn_main"),
             m.Proc(16, 1, f"{py} -m ipykernel_launcher -f k.json"),
             m.Proc(17, 16, "/usr/libexec/gcc/x86_64-linux-gnu/12/cc1plus -quiet x.cpp"),
             m.Proc(18, 1, "/usr/lib/chromium/chromium --headless"),
             m.Proc(19, 1, "/usr/bin/dpkg --status-fd 35 --configure chromium")]
    by_pid = {p.pid: p for p in procs}
    kinds = {p.pid: m.kind(p, by_pid) for p in procs}
    assert kinds == {10: "pytest", 11: "vllm servers", 12: "vllm servers", 13: "vllm servers",
                     14: "grpo_nb train CLIs", 15: "other", 16: "jupyter kernels",
                     17: "compilers", 18: "chromium", 19: "installers"}


def test_a_run_reports_its_commands_cpu_and_exit_code(capsys) -> None:
    m = _module()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    rc = m.main(["--interval", "0.1", "--", sys.executable, "-c", burn + "\nraise SystemExit(3)"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 3 and report["rc"] == 3
    assert 0.8 <= report["command_tree_cpu_s"] <= 1.5  # its one CPU second, sampled to 0.1 s
    assert report["cpu_s_by_kind"]["other"] >= 0.8
    assert report["busy_cpu_s"] >= 0.8 and 0 < report["busy_frac"] <= 1
    assert report["wall_s"] >= 1.0  # (other processes on the machine are counted by kind too:
    # under make test, the other lanes' servers and pytest processes)
    assert all(0 <= w <= 1 for w in report["busy_frac_per_30s"])


def test_cpu_used_before_the_run_is_not_counted() -> None:
    import subprocess
    import time

    m = _module()
    burn = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
            "time.sleep(60)")
    burner = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 60
        while (m.read_proc(str(burner.pid)) or (0, 0, 0.0, ""))[2] < 0.5:  # its half second
            assert time.monotonic() < deadline, "the burner never used its CPU"
            time.sleep(0.05)
        seen: dict = {}
        m.sample(seen, before_the_run=True)
        time.sleep(0.2)
        m.sample(seen)
        proc = next(p for p in seen.values() if p.pid == burner.pid)
        assert proc.base_s >= 0.5 and proc.cpu_s < 0.1, proc  # sleeping since: nothing counted
    finally:
        burner.kill()
        burner.wait()
