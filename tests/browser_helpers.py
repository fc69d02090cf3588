"""Helpers for the handout and browser tests: fixture notebooks and a JupyterLab server.

Data flow of the browser test::

    notebooks (copied to tmp) ──► JupyterServer (subprocess, own process group, loopback, token)
                                        ▲  REST: /api/status, /api/kernels
                                        │
    Playwright ──► Debian's Chromium ──► /lab/tree/NN.ipynb ──► run all ──► screenshots, DOM checks

Everything started here is stopped in ``close()``/``__exit__``: kernels through the REST API,
then the server's whole process group, then any descendant that outlived it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import psutil

from grpo_nb.serving.net import free_port

FIXTURE_SOLUTION = "return 2 * x  # the fixture's secret solution"


def fixture_notebook(steps: int = 5, fail: bool = False) -> nbformat.NotebookNode:
    """A small course-shaped notebook: a live plot, a slider plot, one exercise + solution.

    ``steps`` half-second frames of the live plot; ``fail`` adds a cell that raises.
    """
    v4 = nbformat.v4
    cells = [
        v4.new_markdown_cell(
            "# Fixture: a live plot and a slider\n\nWhat you will learn: that $\\sqrt{x^2} = |x|$.\n\n"
            "**Time:** smoke ~1 min · full ~2 min"
        ),
        v4.new_markdown_cell("A display formula:\n\n$$A_i = \\frac{r_i - \\bar r}{\\sigma + \\varepsilon}$$"),
        v4.new_code_cell(
            "import asyncio\n\nimport ipywidgets as widgets\nimport matplotlib.pyplot as plt\n"
            "from IPython.display import display\n\n"
            "display(widgets.HBox([widgets.HTML('steps'), widgets.IntProgress(value=3, max=5)]))"
        ),
        v4.new_code_cell(
            f"fig, ax = plt.subplots(figsize=(4, 3))\nhandle = display(fig, display_id=True)\n"
            f"xs, ys = [], []\nfor step in range({steps}):\n"
            "    xs.append(step)\n    ys.append((step % 7) ** 0.5)\n"
            "    ax.clear()\n    ax.plot(xs, ys, 'o-')\n    ax.set_title(f'step {step}')\n"
            "    handle.update(fig)\n    await asyncio.sleep(0.5)\nplt.close(fig)"
        ),
        v4.new_code_cell(
            "def draw(eps):\n    fig, ax = plt.subplots(figsize=(4, 3))\n"
            "    ax.plot([0, 1], [0, eps])\n    ax.set_ylim(0, 1)\n    ax.set_title(f'eps = {eps:.2f}')\n"
            "    plt.show()\n\n\n"
            "widgets.interact(draw, eps=widgets.FloatSlider(value=0.2, min=0, max=1, step=0.05));"
        ),
        v4.new_markdown_cell("## Exercise 1\n\nMake `double` return twice its argument."),
        v4.new_code_cell("def double(x):\n    # TODO: your code here\n    return x"),
        v4.new_code_cell(f"def double(x):\n    {FIXTURE_SOLUTION}"),
        v4.new_code_cell("assert double(2) == 4\nprint('self-check passed')"),
    ]
    for cell, tag in zip(cells[5:8], ["exercise", "exercise", "solution"], strict=True):
        cell.metadata["tags"] = [tag]
    if fail:
        cells.append(v4.new_code_cell("raise RuntimeError('fixture failure')"))
    nb = v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return nb


# Raw TeX a page shows when MathJax did not run (the delimiters nbconvert leaves in the text).
RAW_TEX = re.compile(r"\$\$|\\\(|\\\[|\$\\[a-z]+|\\frac|\\sqrt")


def offline_typeset(html_path: Path, wait_s: float = 15.0) -> dict[str, Any]:
    """Open a handout page in Debian's headless Chromium with the network cut off; report what
    MathJax typeset (waiting up to ``wait_s`` after the page's load for MathJax to appear), and
    any TeX left raw in the prose (markdown) cells. Every request that is not a local file is
    aborted and listed."""
    from playwright.sync_api import sync_playwright

    from grpo_nb.course.handouts import CHROMIUM_ARGS, chromium_executable

    blocked: list[str] = []

    def only_files(route: Any) -> None:
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    with contextlib.ExitStack() as stack:
        profile = stack.enter_context(tempfile.TemporaryDirectory())
        pw = stack.enter_context(sync_playwright())
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=chromium_executable(), headless=True, args=CHROMIUM_ARGS,
            offline=True,
        )  # fmt: skip
        stack.callback(ctx.close)
        ctx.route("**/*", only_files)
        page = ctx.new_page()
        page.goto(html_path.resolve().as_uri(), wait_until="load", timeout=60_000)
        loaded = page.evaluate(
            """waitMs => new Promise(done => {
                   const t0 = Date.now();
                   (function poll() {
                       if (window.MathJax && window.MathJax.Hub) {
                           window.MathJax.Hub.Queue(() => done(true));
                       } else if (Date.now() - t0 > waitMs) { done(false); }
                       else { setTimeout(poll, 100); }
                   })();
               })""",
            wait_s * 1000,
        )
        typeset = page.locator(".MathJax_CHTML, mjx-container").count()
        errors = page.locator(".MathJax_Error, merror, .mjx-merror").count()
        # markdown cells only: code cells legitimately show TeX (matplotlib axis labels)
        prose = page.locator(".jp-MarkdownOutput").all_inner_texts()
        text = "\n".join(prose) if prose else page.locator("body").inner_text()
    return {"loaded": loaded, "typeset": typeset, "errors": errors,
            "raw_tex": sorted(set(RAW_TEX.findall(text))), "blocked": blocked}


# What jupyter_server logs before it exits 1 when the port it was given is taken (it binds with
# port_retries=0). free_port() releases its port before the server binds it, so on a loaded
# machine another process (a vLLM server, a health poll's connection) can take it in between.
PORT_TAKEN = re.compile(r"port \d+ is not available|port \d+ is already in use")


class JupyterServer:
    """JupyterLab from this Python environment, on a loopback port with a random token."""

    def __init__(self, notebook_dir: Path, log_path: Path, env: dict[str, str] | None = None):
        self.notebook_dir, self.log_path = notebook_dir, log_path
        self.env = env or dict(os.environ)
        self.token = secrets.token_hex(16)
        self.log = open(log_path, "wb")  # noqa: SIM115 — closed in close()
        self.starts = 0
        self._family: dict[int, psutil.Process] = {}
        self._spawn()

    def _spawn(self) -> None:
        """Start ``jupyter lab`` on a fresh free port (appending to the same log)."""
        self.starts += 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log.write(f"── start {self.starts} on port {self.port}\n".encode())
        self.log.flush()
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", "--allow-root", f"--ServerApp.port={self.port}",
               f"--IdentityProvider.token={self.token}", "--ServerApp.port_retries=0",
               f"--ServerApp.root_dir={self.notebook_dir}",
               # lets the test read cell state from the page (window.jupyterapp), as Galata does
               "--LabApp.expose_app_in_browser=True",
               "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
        )  # fmt: skip

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text).replace(self.token, "***")

    def api(self, path: str, method: str = "GET") -> bytes:
        req = urllib.request.Request(f"{self.url}{path}", method=method)
        req.add_header("Authorization", f"token {self.token}")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read()

    def wait_ready(self, timeout_s: float = 120, max_starts: int = 3) -> None:
        """Wait for ``/api/status``; start again on a new port (up to ``max_starts`` starts in
        all) when the server exited because its port was taken."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                started_here = self.log_path.read_text(errors="replace").split("── start ")[-1]
                if PORT_TAKEN.search(started_here) and self.starts < max_starts:
                    self._spawn()
                    continue
                raise RuntimeError(
                    f"jupyter lab exited with {self.proc.returncode} (start {self.starts}); "
                    f"its log {self.log_path} ends:\n{self.log_tail()}"
                )
            try:
                self.api("/api/status")
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(
            f"jupyter lab not ready after {timeout_s} s; its log {self.log_path} ends:\n"
            f"{self.log_tail()}"
        )

    def lab_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?token={self.token}&reset"

    def remember_children(self) -> None:
        """Note the server's descendants (kernels) so that close() can reap survivors."""
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self._family[p.pid] = p
        except psutil.NoSuchProcess:
            pass

    def shutdown_kernels(self) -> None:
        """Stop every kernel the server runs (they keep running after a page closes)."""
        self.remember_children()
        try:
            for k in json.loads(self.api("/api/kernels")):
                self.api(f"/api/kernels/{k['id']}", method="DELETE")
        except (OSError, ValueError):
            pass  # the server is already gone: close() reaps what it left

    def close(self) -> None:
        self.shutdown_kernels()  # a clean shutdown first, so kernels do not linger as orphans
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for p in self._family.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        self.log.close()

    def __enter__(self) -> JupyterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ── driving a notebook in the page ─────────────────────────────────────────────────────────

# Read from JupyterLab's own models (window.jupyterapp, exposed by the server flag above):
# cell types, execution counts and outputs are what the learner's notebook holds.
_JS_NOTEBOOK = "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
_JS_KERNEL_STATUS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return k ? k.status : null; }"""
_JS_CELLS = """() => window.jupyterapp.shell.currentWidget.content.widgets.map((c, i) => ({
  index: i, type: c.model.type,
  count: c.model.type === 'code' ? c.model.executionCount : null,
  running: c.model.type === 'code' && !!c.node.querySelector('.jp-InputPrompt')
           && c.node.querySelector('.jp-InputPrompt').textContent.includes('*'),
  errors: c.model.type === 'code'
          ? c.model.outputs.toJSON().filter(o => o.output_type === 'error')
              .map(o => o.ename + ': ' + o.evalue) : [],
  images: Array.from(c.node.querySelectorAll('.jp-OutputArea-output img')).map(e => e.src),
  sliders: c.node.querySelectorAll('.widget-slider').length,
  widgets: c.node.querySelectorAll('.jp-OutputArea-output .jupyter-widgets').length,
  text: c.model.type === 'code'
        ? Array.from(c.node.querySelectorAll('.jp-OutputArea-output')).map(e => e.innerText).join('\\n')
        : '',
}))"""
# What a learner sees instead of a widget when the widget manager is missing or mismatched.
WIDGET_FAILURES = re.compile(
    r"Loading widget|Error displaying widget|Failed to load model class|model not found"
    r"|\b(?:interactive|VBox|HBox)\(children=|\b(?:Float|Int)(?:Slider|Progress)\(value="
)


def lab_settings(root: Path) -> dict[str, str]:
    """Fresh JupyterLab settings (news and update checks off) so no toast covers the page."""
    settings = root / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    return {
        "JUPYTERLAB_SETTINGS_DIR": str(root / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(root / "workspaces"),
    }


class LabPage:
    """One Chromium page showing one notebook in JupyterLab."""

    def __init__(self, page: Any, server: JupyterServer, shots: Path):
        self.page, self.server, self.shots = page, server, shots

    def open(self, notebook: str, timeout_s: float = 180) -> None:
        """Open ``notebook`` and wait until its kernel is idle (accepting a kernel dialog)."""
        self.page.goto(self.server.lab_url(notebook), timeout=timeout_s * 1000)
        self.page.wait_for_function(
            f"() => ({_JS_NOTEBOOK})() && ({_JS_NOTEBOOK})().title.label === {json.dumps(notebook)}",
            timeout=timeout_s * 1000,
        )
        deadline = time.monotonic() + timeout_s
        while self.page.evaluate(_JS_KERNEL_STATUS) != "idle":
            accept = self.page.query_selector(".jp-Dialog .jp-mod-accept")
            if accept is not None:  # "Select Kernel" when a notebook names no kernelspec
                accept.click()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{notebook}: kernel not idle after {timeout_s} s")
            time.sleep(0.5)

    def cells(self) -> list[dict[str, Any]]:
        return self.page.evaluate(_JS_CELLS)

    def run_all(self) -> None:
        # Not awaited in the page: the command's promise resolves only when every cell is done.
        self.page.evaluate(
            "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"
        )

    def is_done(self) -> bool:
        cells = self.cells()
        started = any(c["count"] is not None or c["running"] for c in cells)
        return (
            started
            and not any(c["running"] for c in cells)
            and self.page.evaluate(_JS_KERNEL_STATUS) == "idle"
        )

    def shot(self, name: str, cell: int | None = None) -> Path:
        """A screenshot of one cell's outputs (or of the page), saved under ``shots``."""
        path = self.shots / f"{name}.png"
        if cell is None:
            self.page.screenshot(path=str(path))
        else:
            area = (
                self.page.locator(".jp-Notebook .jp-Cell").nth(cell).locator(".jp-Cell-outputArea")
            )
            area.scroll_into_view_if_needed()
            area.screenshot(path=str(path))
        return path


@dataclass
class LivePlot:
    """Two screenshots of one cell's plot taken while that cell was still running."""

    cell: int
    shots: list[Path] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    srcs: list[list[str]] = field(default_factory=list)


def run_and_watch(lab: LabPage, name: str, timeout_s: float, gap_s: float = 2.0) -> list[LivePlot]:
    """Run all cells; screenshot each running cell's plot twice, ``gap_s`` or more apart.

    The first shot is taken when a running cell first shows an image, the second at the first
    poll at least ``gap_s`` later when the image differs from the first one.
    """
    lab.run_all()
    plots: dict[int, LivePlot] = {}
    start = time.monotonic()
    while not lab.is_done():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{name}: cells still running after {timeout_s} s")
        now = time.monotonic()
        for c in lab.cells():
            if not (c["running"] and c["images"]):
                continue
            plot = plots.setdefault(c["index"], LivePlot(c["index"]))
            if not plot.shots or (
                len(plot.shots) == 1
                and now - plot.times[0] >= gap_s
                and c["images"] != plot.srcs[0]
            ):
                src = c["images"]
                plot.shots.append(
                    lab.shot(f"{name}-cell{c['index']}-live{len(plot.shots) + 1}", c["index"])
                )
                plot.times.append(now)
                plot.srcs.append(src)
        time.sleep(0.3)
    return list(plots.values())
