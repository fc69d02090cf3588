"""``doctor``'s machine checks (grpo_nb/course/machine.py): the platform, a working compiler, free
memory and free disk. Each is faked failing here and must block the notebooks it stops with a
one-line fix; on this machine (Linux x86_64 with g++) the real checks pass."""

from __future__ import annotations

import platform
import shutil
import stat
from collections import namedtuple
from pathlib import Path

import pytest

from grpo_nb.config import smoke_mode
from grpo_nb.course import doctor, machine

VLLM_NOTEBOOKS = [k for k, n in doctor.NOTEBOOK_NEEDS.items() if "vllm" in n.packages]
TOY_NOTEBOOKS = [k for k in doctor.NOTEBOOK_NEEDS if k not in VLLM_NOTEBOOKS]


def _one_line(problem: str | None) -> str:
    assert problem and "\n" not in problem, problem
    return problem


def _script(tmp_path: Path, body: str) -> Path:
    """An executable stand-in for a compiler."""
    path = tmp_path / "fake-cc"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture(autouse=True)
def _fresh_compile_results() -> None:
    machine._try_compile.cache_clear()


def test_this_machine_passes_every_machine_check() -> None:
    report = doctor.diagnose()
    assert [c.name for c in report.checks] == ["platform", "C++ compiler", "free disk"]
    assert all(c.problem is None for c in report.checks), report.checks
    assert "compiled a test file" in report.checks[1].line
    text = doctor.format_report(report)
    assert "  platform       Linux x86_64: ok" in text and "  free disk      " in text


@pytest.mark.parametrize("system, arch, fix", [
    ("Darwin", "arm64", "on macOS notebooks 01-03 run natively"),
    ("Windows", "AMD64", "WSL2"),
    ("Linux", "aarch64", "Linux x86_64 machine or VM"),
])
def test_an_unsupported_platform_blocks_the_vllm_notebooks(
        monkeypatch: pytest.MonkeyPatch, system: str, arch: str, fix: str) -> None:
    monkeypatch.setattr(platform, "system", lambda: system)
    monkeypatch.setattr(platform, "machine", lambda: arch)
    report = doctor.diagnose()
    for key in VLLM_NOTEBOOKS:
        problem = next(p for p in report.verdicts[key] if "wheels only" in p)
        assert f"{system} {arch}" in _one_line(problem) and fix in problem, problem
    assert all(not any("wheels only" in p for p in report.verdicts[k]) for k in TOY_NOTEBOOKS)
    assert f"{system} {arch}: NOT supported" in doctor.format_report(report)
    assert doctor.cli(["--notebook", "05"]) == 1
    with pytest.raises(RuntimeError, match="notebook 04 .* cannot run: .*wheels only"):
        doctor.check("04")


def test_cuda_wheels_cover_linux_aarch64_but_not_macos() -> None:
    assert machine.platform_check(True, "Linux", "aarch64").problem is None
    assert machine.platform_check(False, "Linux", "aarch64").problem
    assert machine.platform_check(True, "Darwin", "arm64").problem


def test_no_compiler_on_path_blocks_the_vllm_notebooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    report = doctor.diagnose()
    for key in VLLM_NOTEBOOKS:
        problem = next(p for p in report.verdicts[key] if "compiler" in p)
        assert "no C++ compiler (g++) on PATH" in _one_line(problem), problem
        assert "apt-get install build-essential" in problem and "CXX" in problem
    assert report.verdicts["01"] == []
    assert "C++ compiler   none found" in doctor.format_report(report)


def test_a_compiler_that_fails_is_reported_with_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _script(tmp_path, 'echo "probe.cpp:1:10: fatal error: omp.h: No such file" >&2; exit 1')
    monkeypatch.setenv("CXX", str(fake))
    check = machine.compiler_check(cuda=False)
    assert check.line == f"{fake}: BROKEN"
    problem = _one_line(check.problem)
    assert "failed (exit 1)" in problem and "omp.h: No such file" in problem, problem
    assert "-fopenmp" in problem and "apt-get install build-essential" in problem
    monkeypatch.setenv("CC", str(fake))  # a GPU machine: Triton's C compiler, $CC
    assert "failed (exit 1)" in _one_line(machine.compiler_check(cuda=True).problem)


def test_a_compiler_that_hangs_is_stopped_at_the_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(_script(tmp_path, "exec sleep 30")))
    check = machine.compiler_check(cuda=False, timeout_s=0.5)
    assert "did not finish in 0.5 s" in _one_line(check.problem), check
    assert check.line.endswith(": BROKEN")


def test_little_free_disk_blocks_every_notebook(monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(*real(p)[:2], int(0.3 * 2**30)))
    report = doctor.diagnose()
    for key in doctor.NOTEBOOK_NEEDS:
        problem = next(p for p in report.verdicts[key] if "disk" in p or "GiB free at" in p)
        assert "only 0.3 GiB free at" in _one_line(problem), problem
        assert "GRPO_NB_CACHE" in problem and "1 GiB needed" in problem
    assert "too little" in doctor.format_report(report)


def test_too_little_memory_blocks_the_notebooks_that_need_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    memory = namedtuple("memory", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(int(2.5 * 2**30)))
    report = doctor.diagnose()
    for key, needs in doctor.NOTEBOOK_NEEDS.items():
        memory_problems = [p for p in report.verdicts[key] if "of memory free" in p]
        if needs.min_free_gib > 2.5:
            assert memory_problems, (key, report.verdicts[key])
            assert f"{needs.min_free_gib:.0f} GiB needed" in _one_line(memory_problems[0])
            assert "Shut Down All Kernels" in memory_problems[0]
        else:
            assert not memory_problems, (key, memory_problems)
    assert VLLM_NOTEBOOKS and all(doctor.NOTEBOOK_NEEDS[k].min_free_gib > 2.5
                                  for k in VLLM_NOTEBOOKS)


class _FakeRoom:
    """Stand-ins for the warm-up's pieces: they record what was started, in order."""

    def __init__(self, tmp_path: Path, fail_at: str | None = None) -> None:
        self.model_dir, self.fail_at, self.started = tmp_path / "tiny-qwen3-x", fail_at, []

    def pieces(self) -> machine.WarmUp:
        return machine.WarmUp(lambda: self.model_dir, self.servers, self.start)

    def servers(self, model: Path) -> list[tuple[str, str]]:
        return [("notebook 04", f"cfg04:{model.name}"), ("notebook 05", f"cfg05:{model.name}")]

    def start(self, cfg: str) -> float:
        self.started.append(cfg)
        if cfg.startswith(self.fail_at or "-"):
            raise RuntimeError("vLLM exited with code 1 after 3 s; log runs/vllm/x.log:\nTraceback…")
        return 40.0 if len(self.started) <= 2 else 4.0


@pytest.fixture
def _plenty_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    memory = namedtuple("memory", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(16 * 2**30))


@pytest.mark.usefixtures("_plenty_of_memory")
def test_workshop_warm_up_starts_each_notebook_server_then_the_first_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    room = _FakeRoom(tmp_path)
    monkeypatch.setattr(machine, "default_warm_up", room.pieces)
    assert doctor.cli(["--workshop"]) == 0
    assert room.started == ["cfg04:tiny-qwen3-x", "cfg05:tiny-qwen3-x", "cfg04:tiny-qwen3-x"]
    out = capsys.readouterr().out
    mode = "smoke" if smoke_mode() else "full"
    assert f"workshop warm-up, {mode} mode" in out and "tiny-qwen3-x: ready in" in out
    assert f"{'notebook 05':<20} vLLM server healthy in 40 s (compiled, its caches filled)" in out
    assert (f"{'notebook 04 again':<20} vLLM server healthy in 4 s (the room's first start will "
            "take about this long)") in out
    assert out.rstrip().endswith("ready.")
    room.started.clear()
    assert doctor.cli([]) == 0 and room.started == []  # without --workshop nothing starts


@pytest.mark.usefixtures("_plenty_of_memory")
def test_a_server_that_fails_to_start_ends_the_warm_up_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    room = _FakeRoom(tmp_path, fail_at="cfg05")
    monkeypatch.setattr(machine, "default_warm_up", room.pieces)
    assert doctor.cli(["--workshop"]) == 1
    assert room.started == ["cfg04:tiny-qwen3-x", "cfg05:tiny-qwen3-x"]  # no start after it
    err = capsys.readouterr().err
    problem = _one_line(err.strip().removeprefix("not ready: "))
    assert problem.startswith("notebook 05's vLLM server failed: RuntimeError: vLLM exited with "
                              "code 1 after 3 s; log runs/vllm/x.log:"), problem
    assert "python -m grpo_nb doctor" in problem and "Traceback" not in problem
    checks = machine.warm_caches(_FakeRoom(tmp_path, fail_at="cfg").pieces())
    assert [c.name for c in checks] == ["tiny model", "notebook 04's vLLM server"]


def test_the_warm_up_is_skipped_when_the_vllm_notebooks_cannot_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    room = _FakeRoom(tmp_path)
    monkeypatch.setattr(machine, "default_warm_up", room.pieces)
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert doctor.cli(["--workshop"]) == 1 and room.started == []
    out = capsys.readouterr().out
    assert "workshop warm-up: skipped" in out and "notebook 04 is not ready" in out


def test_the_warm_up_starts_the_notebooks_own_servers_compiled(
        random_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's compile cache is keyed on the settings (max_model_len, the model folder, ...): the
    # warm-up must start exactly the servers notebooks 04 and 05 start, and compiled even where
    # GRPO_NB_SERVER_EAGER=1 (the suite's setting) is inherited.
    from grpo_nb.serving.server import EAGER_ENV

    monkeypatch.setenv(EAGER_ENV, "1")
    servers = dict(machine.notebook_servers(random_model_dir))
    assert list(servers) == ["notebook 04", "notebook 05"]
    for cfg in servers.values():
        assert cfg.eager is False and cfg.model == str(random_model_dir)
        assert "--enforce-eager" not in cfg.command(8000, gpu=False)
    assert servers["notebook 05"].worker_extension_cls  # 05's server takes weight syncs
    # notebook 04's cell serves the ring's context, so both notebooks use one compile cache key
    assert servers["notebook 04"].max_model_len == servers["notebook 05"].max_model_len
    nb04 = (Path(__file__).parents[1] / "notebooks" / "04_vllm_rollouts.ipynb").read_text()
    assert "max_model_len=LLMConfig().resolve().context_len" in nb04
