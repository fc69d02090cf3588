"""The notebooks as learners see them: JupyterLab in headless Chromium (Debian's), via Playwright.

Data flow::

    notebooks/ ──copy──► tmp/notebooks (+ a fixture) ──► JupyterLab (this venv, loopback, token,
                                                           GRPO_NB_SMOKE=1 and, so that every
                                                           exercise checker runs its solution,
                                                           GRPO_NB_SOLUTIONS=1 for its kernels)
    Playwright ──► /usr/bin/chromium ──► open NN.ipynb ──► run all ──► screenshots + checks
                                                                      └─► build/browser/*.png

Checks per notebook: the live plot changes between two screenshots taken while its cell runs,
widgets render (no "Loading widget…" placeholder, no version-mismatch error, no text fallback),
no cell holds an error output; in 02 and 03, dragging a slider redraws the plot. 05 needs a
vLLM server (``make nbtest`` runs it); its section 7 cost model and slider run here on the
recorded runs, in a notebook made of those cells. A fixture notebook
with a deliberate error proves the checks can fail. The committed notebooks are never touched.
``make nbtest`` leaves out the notebooks run here: this is where they execute, every cell.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from browser_helpers import (
    WIDGET_FAILURES,
    JupyterServer,
    LabPage,
    fixture_notebook,
    lab_settings,
    run_and_watch,
)
from playwright.sync_api import sync_playwright

from grpo_nb.course.handouts import CHROMIUM_ARGS, chromium_executable

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
SHOTS = REPO / "build" / "browser"
# notebook → what it must show: a live plot that changes while its cell runs, a slider whose
# drag redraws its plot and, where given, a printed line (by its start) that the drag changes
IN_BROWSER = {"02_toy_grpo_ring.ipynb": ("live plot", "slider", "predicted speed-up"),
              "03_grpo_objective.ipynb": ("slider",)}


# 05 needs a vLLM server for most cells, so it runs under nbmake, not here; its section 7 cost
# model and slider need only the two runs, so they run here on the recorded ones, after a
# prelude that stands in for the cells above them (the runs, cfg's checkpoint_every, imports).
COST_MODEL_05 = "zz_05_cost_model.ipynb"
CELLS_05 = ["9d41f0b6", "b64fdd96", "cb685cb8"]  # the cost model; the slider's text and cell
PRELUDE_05 = """%matplotlib inline
import json
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import display

from grpo_nb.llm.dashboard import recorded_run

RECORDED = Path("recorded")
res_async, rec_async = recorded_run(RECORDED / "nb05-async")
res_sync, rec_sync = recorded_run(RECORDED / "nb05-sync")
cfg = SimpleNamespace(**json.loads((RECORDED / "nb05-sync" / "config.json").read_text()))
server = SimpleNamespace(cpus=[])  # the recorded runs' server is gone"""


def cost_model_05() -> nbformat.NotebookNode:
    """Notebook 05's cost-model and slider cells (by id, outputs dropped) after the prelude."""
    nb05 = nbformat.read(REPO / "notebooks" / "05_async_grpo.ipynb", as_version=4)
    by_id = {c.get("id"): c for c in nb05.cells}
    cells = [nbformat.v4.new_code_cell(PRELUDE_05)]
    for cell_id in CELLS_05:
        cell = nbformat.from_dict(dict(by_id[cell_id]))
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cells.append(cell)
    return nbformat.v4.new_notebook(cells=cells, metadata=nb05.metadata)


@pytest.fixture(scope="module")
def lab_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[JupyterServer, object]]:
    """A JupyterLab server on a copy of the notebooks, and a Chromium browser context."""
    root = tmp_path_factory.mktemp("lab")
    nb_dir = root / "notebooks"
    shutil.copytree(REPO / "notebooks", nb_dir, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    nbformat.write(fixture_notebook(steps=12, fail=True), nb_dir / "zz_fixture.ipynb")
    nbformat.write(cost_model_05(), nb_dir / COST_MODEL_05)
    SHOTS.mkdir(parents=True, exist_ok=True)  # not wiped: xdist workers may share it
    print(f"\n[browser] screenshots: {SHOTS}")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    env = {**os.environ, "GRPO_NB_SMOKE": "1", "GRPO_NB_SOLUTIONS": "1", **lab_settings(root)}
    with (
        JupyterServer(nb_dir, SHOTS / f"jupyter-{worker}.log", env=env) as server,
        tempfile.TemporaryDirectory() as profile,
        sync_playwright() as pw,
    ):
        server.wait_ready()
        ctx = pw.chromium.launch_persistent_context(
            profile,
            executable_path=chromium_executable(),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield server, ctx
        finally:
            ctx.close()


@pytest.fixture
def lab(lab_env: tuple[JupyterServer, object]) -> Iterator[LabPage]:
    server, ctx = lab_env
    page = ctx.new_page()  # type: ignore[attr-defined]
    try:
        yield LabPage(page, server, SHOTS)
    finally:
        page.close()
        server.shutdown_kernels()  # one notebook's kernel at a time on 2 cores


def _widget_failures(cells: list[dict]) -> list[str]:
    return [
        f"cell {c['index']}: {m.group(0)}"
        for c in cells
        if (m := WIDGET_FAILURES.search(c["text"]))
    ]


def _errors(cells: list[dict]) -> list[str]:
    return [f"cell {c['index']}: {e}" for c in cells for e in c["errors"]]


def _assert_live_plot(plots: list, name: str) -> None:
    changed = [p for p in plots if len(p.shots) == 2]
    assert changed, f"{name}: no plot changed while its cell ran; shots: {[p.shots for p in plots]}"
    p = changed[0]
    assert p.shots[0].read_bytes() != p.shots[1].read_bytes(), f"{name}: identical screenshots"
    assert p.times[1] - p.times[0] >= 2.0
    print(f"[browser] {name}: live plot in cell {p.cell}: {p.shots[0].name}, {p.shots[1].name}")


def _drag_first_slider(lab: LabPage, name: str) -> tuple[Path, Path]:
    """Drag the first slider of a cell that also shows a plot; return before/after shots."""
    cells = lab.cells()
    target = next((c for c in cells if c["sliders"] and c["images"]), None)
    assert target is not None, f"{name}: no cell shows both a slider and a plot"
    before = lab.shot(f"{name}-cell{target['index']}-slider-before", target["index"])
    cell = lab.page.locator(".jp-Notebook .jp-Cell").nth(target["index"])
    handle = cell.locator(".widget-slider .noUi-handle").first
    handle.scroll_into_view_if_needed()
    box = handle.bounding_box()
    assert box is not None
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    lab.page.mouse.move(x, y)
    lab.page.mouse.down()
    lab.page.mouse.move(x + 60, y, steps=8)
    lab.page.mouse.up()
    deadline = time.monotonic() + 60
    while lab.cells()[target["index"]]["images"] == target["images"]:
        assert time.monotonic() < deadline, f"{name}: plot did not change after moving the slider"
        time.sleep(0.3)
    time.sleep(1.0)  # let the redraw settle before the screenshot
    after = lab.shot(f"{name}-cell{target['index']}-slider-after", target["index"])
    assert before.read_bytes() != after.read_bytes()
    return before, after


def _lines_of_slider_cell(lab: LabPage, start: str) -> list[str]:
    """The lines starting with ``start`` that the slider's cell prints (scrolled into view:
    JupyterLab does not render the text of cells out of view)."""
    index = next(c["index"] for c in lab.cells() if c["sliders"] and c["images"])
    lab.page.locator(".jp-Notebook .jp-Cell").nth(index).scroll_into_view_if_needed()
    deadline = time.monotonic() + 30
    while not (lines := [ln for ln in lab.cells()[index]["text"].splitlines() if ln.startswith(start)]):
        assert time.monotonic() < deadline, f"the slider's cell prints no line starting {start!r}"
        time.sleep(0.3)
    return sorted(set(lines))  # a widget's output area sits inside the cell's: its text twice


def test_fixture_checks_can_fail(lab: LabPage) -> None:
    """The checks on a fixture: live plot and slider work, its deliberate error is caught."""
    lab.open("zz_fixture.ipynb")
    plots = run_and_watch(lab, "fixture", timeout_s=180)
    lab.shot("fixture-page")
    cells = lab.cells()
    assert _errors(cells) == [f"cell {len(cells) - 1}: RuntimeError: fixture failure"]
    _assert_live_plot(plots, "fixture")
    assert _widget_failures(cells) == []
    assert sum(c["widgets"] for c in cells) > 0
    _drag_first_slider(lab, "fixture")
    # the widget check sees a text fallback, as when the widget manager is missing
    assert _widget_failures([{**cells[0], "text": "interactive(children=(FloatSlider(v"}])


@pytest.mark.parametrize(("notebook", "checks"), list(IN_BROWSER.items()))
def test_notebook_in_jupyterlab(lab: LabPage, notebook: str, checks: tuple[str, ...]) -> None:
    if not (REPO / "notebooks" / notebook).exists():
        pytest.fail(f"notebooks/{notebook} does not exist yet")
    name = notebook.split("_")[0]
    lab.open(notebook)
    plots = run_and_watch(lab, name, timeout_s=600)
    lab.shot(f"{name}-page")
    cells = lab.cells()
    assert _errors(cells) == [], f"{notebook}: cells show errors"
    assert _widget_failures(cells) == [], f"{notebook}: widgets did not render"
    if "live plot" in checks:
        _assert_live_plot(plots, name)
        assert sum(c["widgets"] for c in cells) > 0, f"{notebook}: no widget rendered"
    if "slider" in checks:
        printed = set(checks) - {"live plot", "slider"}  # lines the drag must change
        shown = {start: _lines_of_slider_cell(lab, start) for start in printed}
        before, after = _drag_first_slider(lab, name)
        print(f"[browser] {name}: slider moved: {before.name}, {after.name}")
        assert _errors(lab.cells()) == [], f"{notebook}: moving the slider raised"
        for start, lines in shown.items():
            moved = _lines_of_slider_cell(lab, start)
            assert lines != moved, f"{notebook}: {start!r} did not change: {lines}"
            print(f"[browser] {name}: {lines} -> {moved}")


def test_nbtest_runs_every_notebook_not_run_here() -> None:
    """Every course notebook is executed once: here (in JupyterLab) or by ``make nbtest``."""
    dry = subprocess.run(["make", "-s", "-n", "--no-print-directory", "nbtest"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    (line,) = [ln for ln in dry.splitlines() if "--nbmake" in ln]
    nbmake = set(re.findall(r"notebooks/([^\s/]+\.ipynb)", line))
    course = {p.name for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert nbmake | set(IN_BROWSER) == course, f"executed by neither: {course - nbmake - set(IN_BROWSER)}"
    assert not nbmake & set(IN_BROWSER), f"executed twice: {nbmake & set(IN_BROWSER)}"


def test_05_cost_model_slider_headless(monkeypatch: pytest.MonkeyPatch) -> None:
    """05's slider cells on the recorded runs, without a browser: the figure starts at the
    prediction the cost-model cell prints, and moving a slider changes the predicted speed-up."""
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(REPO / "notebooks")  # the kernel's working directory
    ns: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cell in cost_model_05().cells:
            if cell.cell_type == "code":
                code = "\n".join(ln for ln in cell.source.splitlines() if not ln.startswith("%"))
                exec(compile(code, "05", "exec"), ns)

    def predicted(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.startswith("predicted speed-up")]

    (first,) = predicted(out.getvalue())
    assert first.startswith(f"predicted speed-up {ns['pred'].model_speedup:.2f}x"), first
    g_slider = ns["explorer"].children[0]
    assert g_slider.description == "G (s)" and g_slider.value == ns["pred"].G
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        g_slider.value = g_slider.value / 4  # generation 4x cheaper: less for overlap to hide
    (moved,) = predicted(out.getvalue())
    quarter = ns["model_at"](ns["pred"].G / 4, ns["pred"].T, ns["pred"].S, ns["pred"].S_server,
                             ns["pause_mode"] != "none")
    assert moved != first and moved.startswith(
        f"predicted speed-up {quarter.model_speedup:.2f}x"), (first, moved)


def test_05_cost_model_slider_in_jupyterlab(lab: LabPage) -> None:
    """The same cells in JupyterLab: they run without error, the widgets render, and dragging
    the first slider redraws the figure and changes the printed predicted speed-up."""
    lab.open(COST_MODEL_05)
    run_and_watch(lab, "05-cost-model", timeout_s=300)
    cells = lab.cells()
    assert _errors(cells) == [] and _widget_failures(cells) == [], cells
    shown = _lines_of_slider_cell(lab, "predicted speed-up")
    before, after = _drag_first_slider(lab, "05-cost-model")
    assert _errors(lab.cells()) == []
    moved = _lines_of_slider_cell(lab, "predicted speed-up")
    assert shown != moved, shown
    print(f"[browser] 05 cost model: {shown} -> {moved} ({before.name}, {after.name})")
