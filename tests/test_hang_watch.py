"""scripts/nb_hang_watch.py (make nbwatch): a notebook run that stops making progress is
caught, every Python stack in its tree is saved, and the whole tree is ended."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
PY_SPY = Path(sys.executable).with_name("py-spy")


def test_a_frozen_kernel_is_caught_dumped_and_killed(tmp_path: Path) -> None:
    if not PY_SPY.exists():
        pytest.fail(f"no py-spy at {PY_SPY}: pip install -e '.[dev]'")
    nb = nbformat.v4.new_notebook()
    # a kernel that waits without using CPU, as one stuck on a dead peer's socket would
    nb.cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(90)")]
    path = tmp_path / "frozen.ipynb"
    nbformat.write(nb, path)
    out = tmp_path / "hang"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "nb_hang_watch.py"), str(path), "--runs", "1",
         "--stall-s", "10", "--timeout", "120", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr  # a stalled run counts as a failure
    report = json.loads(res.stdout.strip().splitlines()[-1])
    stalled = report["stalled"]
    assert stalled is not None and stalled["after_s"] < 80, report  # before the sleep ends
    pids = {int(line.split(":")[0]): line for line in stalled["processes"]}  # "pid: cmd"
    kernels = [pid for pid, line in pids.items() if "ipykernel" in line]
    assert kernels, stalled["processes"]
    dump = (Path(stalled["dumps"]) / f"{kernels[0]}.txt").read_text()
    assert re.search(r"<module> \(\d+\.py:2\)", dump), dump  # the cell's line 2: the sleep
    for pid, line in pids.items():  # nothing of the run is left behind
        assert not psutil.pid_exists(pid) or \
            psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, line
