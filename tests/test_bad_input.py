"""Bad input to ``python -m grpo_nb train``'s data and resume paths: each is one ``error:`` line
that names the file and the line, field or what a run folder holds, exit 2, no traceback, and
neither a server nor a run folder left behind (the data loads before both). No server starts:
the cases run the CLI in this process with the server's constructor made to fail the test, and
two of them in a process of their own (≈ 10 s each: its imports) for the exit code, the stderr
and the processes left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOOD = {"question": "1+1?", "answer": "#### 2"}


def _jsonl(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# name: (file name, its text, what the one error line must contain besides the file's path)
DATA_CASES: dict[str, tuple[str, str, list[str]]] = {
    "malformed line": ("d.jsonl", _jsonl([GOOD, GOOD]) + '{"question": "3+3?" "answer": "6"}\n',
                       ["line 3 column 21", "Expecting ',' delimiter", "JSON Lines"]),
    "not JSON at all": ("d.jsonl", "question,answer\n1+1?,2\n",
                        ["line 1 column 1", "Expecting value", "JSON Lines"]),
    "not JSON, .json": ("d.json", '[{"question": "1+1?", "answer": "#### 2"},\n  oops]\n',
                        ["line 2 column 3", "Expecting value"]),
    "a row that is no object": ("d.json", json.dumps([GOOD, [1, 2]]),
                                ["item 1 of the top-level list", "not a row object"]),
    "no answer field": ("d.jsonl", _jsonl([{"question": "1+1?"}, {"question": "2+2?"}]),
                        ["'question' field but no 'answer' field", "GSM8K"]),
    "a row without its answer": ("d.jsonl", _jsonl([GOOD, {"question": "2+2?"}, GOOD, GOOD]),
                                 ["row 2 (counting from 1)", "no 'answer' value"]),
    "not Parquet": ("d.parquet", "question,answer\n", ["not a Parquet file"]),
}


def _subprocess(args: list[str], runs: Path, model: Path) -> tuple[int, str, list[object]]:
    """``train --smoke --model MODEL ARGS`` in a process of its own: its exit code, its stderr,
    and the processes it started that are still alive (a server carries its owner's pid)."""
    from grpo_nb.serving.processes import owned_by

    proc = subprocess.Popen([sys.executable, "-m", "grpo_nb", "train", "--smoke", "--model",
                             str(model), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "GRPO_NB_RUNS": str(runs)})
    _, stderr = proc.communicate(timeout=180)
    return proc.returncode, stderr, owned_by(proc.pid)


def _in_process(args: list[str], model: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The same command in this process (its imports paid once): exit code and stderr."""
    from grpo_nb.llm import cli

    try:
        rc = cli.cli(["--smoke", "--model", str(model), *args])
    except SystemExit as exit_:  # argparse's error(): usage, then the error line
        rc = int(exit_.code or 0)
    return rc, capsys.readouterr().err


def _assert_one_error(rc: int, stderr: str, runs: Path, must: list[str]) -> None:
    assert rc == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, stderr[-3000:]
    for text in must:
        assert text in errors[0], (text, errors[0])
    assert not list(runs.iterdir()), list(runs.iterdir())  # no run folder, no server log


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty runs folder; a server made in this process fails the test (bad input must be
    reported before one is made)."""
    from grpo_nb.llm import run

    def no_server(*args: object) -> None:
        raise AssertionError("bad input reached the server's start")

    monkeypatch.setattr(run, "server_for", no_server)
    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path / "runs"))
    (tmp_path / "runs").mkdir()
    return tmp_path / "runs"


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_a_bad_dataset_file_is_one_error_naming_file_and_line_or_field(
        case: str, tmp_path: Path, runs: Path, tiny_model_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    name, text, must = DATA_CASES[case]
    path = tmp_path / name
    path.write_text(text)
    rc, stderr = _in_process(["--dataset", str(path)], tiny_model_dir, capsys)
    _assert_one_error(rc, stderr, runs, [str(path), *must])


def _run_folder(folder: Path, config: str | None, checkpoint: bool) -> Path:
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config)
    if checkpoint:
        (folder / "checkpoint").mkdir()
        (folder / "checkpoint" / "trainer_state.json").write_text("{}")
    return folder


# name: (config.json's text (None: no file), a checkpoint?, what the error line must contain)
RESUME_CASES: dict[str, tuple[str | None, bool, list[str]]] = {
    "corrupt config.json": ('{"steps": 3,\n', True,
                            ["config.json, line 2 column 1", "JSON object of LLMConfig fields"]),
    "config.json not an object": ("[3]", True, ["config.json holds a JSON list"]),
    "unknown field": ('{"stepz": 3}', True, ["config.json has field(s) stepz"]),
    "no config.json": (None, True, ["no config.json in it", "holds config.json and checkpoint/"]),
    "no checkpoint": ('{"steps": 3}', False, ["checkpoint/trainer_state.json is missing"]),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_a_bad_resume_folder_is_one_error_naming_what_a_run_folder_holds(
        case: str, tmp_path: Path, runs: Path, tiny_model_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    config, checkpoint, must = RESUME_CASES[case]
    folder = _run_folder(tmp_path / "run", config, checkpoint)
    rc, stderr = _in_process(["--resume", str(folder)], tiny_model_dir, capsys)
    _assert_one_error(rc, stderr, runs, [f"--resume {folder}", *must])


@pytest.mark.parametrize("args, must", [
    (["--dataset", "{tmp}/d.jsonl"], ["d.jsonl, line 3 column 21", "JSON Lines"]),
    (["--resume", "{tmp}/no-such-run"], ["--resume", "no-such-run: no such folder",
                                         "holds config.json and checkpoint/trainer_state.json"]),
])
def test_the_cli_exits_2_with_no_traceback_and_no_process_left(
        args: list[str], must: list[str], tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "d.jsonl").write_text(DATA_CASES["malformed line"][1])
    runs = tmp_path / "runs"
    runs.mkdir()
    rc, stderr, left = _subprocess([a.format(tmp=tmp_path) for a in args], runs, tiny_model_dir)
    assert not left, left
    _assert_one_error(rc, stderr, runs, must)


def test_a_folder_names_its_bad_file_and_line(tmp_path: Path) -> None:
    from grpo_nb import tasks
    from grpo_nb.config import InputError

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.jsonl").write_text(_jsonl([GOOD, GOOD]))
    (tmp_path / "data" / "train.jsonl").write_text(_jsonl([GOOD]) + "{oops\n")
    with pytest.raises(InputError, match=r"data/train\.jsonl, line 2 column 2: Expecting "):
        tasks.load_task(str(tmp_path / "data"))


def test_a_file_the_loader_still_refuses_is_named_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from grpo_nb import tasks
    from grpo_nb.config import InputError

    def refuse(*args: object, **kwargs: object) -> None:  # as datasets wraps pyarrow's error
        try:
            raise ValueError("Column(/answer) changed from string to number in row 3")
        except ValueError as err:
            raise datasets.exceptions.DatasetGenerationError("An error occurred") from err

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    path = tmp_path / "d.jsonl"
    path.write_text(_jsonl([GOOD] * 3))
    with pytest.raises(InputError, match=r"d\.jsonl: the json loader could not read it "
                       r"\(ValueError: Column\(/answer\) changed from string to number in row 3\)"):
        tasks.load_task(str(path))


def test_a_good_run_folder_gives_back_its_config(tmp_path: Path) -> None:
    from grpo_nb.llm.cli import resumed_config
    from grpo_nb.llm.config import LLMConfig

    folder = _run_folder(tmp_path / "run", json.dumps(LLMConfig(steps=7).to_dict()), True)
    assert resumed_config(folder).steps == 7
