"""Executing notebooks and rendering them for handouts: HTML pages with Debian's MathJax copied
beside them (offline), and a PDF printed by Debian's Chromium through Playwright (nbconvert's
``WebPDFExporter`` would download a browser).
"""

from __future__ import annotations

import copy
import html
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
FROM_WIDGET = "grpo_nb_from_widget"  # output metadata flag: this output was inside a widget
LOCAL_MATHJAX = Path("/usr/share/javascript/mathjax/MathJax.js")
MATHJAX_CONFIG = "TeX-AMS_CHTML-full,Safe"  # nbconvert's own choice for its CDN copy
# What MATHJAX_CONFIG loads in a browser (TeX in, CommonHTML out, its web fonts)
MATHJAX_PARTS = ("MathJax.js", "config/TeX-AMS_CHTML-full.js", "config/Safe.js", "extensions",
                 "jax/input/TeX", "jax/output/CommonHTML", "jax/element",
                 "fonts/HTML-CSS/TeX/woff", "localization/en")
# Offline: background networking, component updates and sync would stall page loads; root in a
# container: Chromium's sandbox cannot start.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def execute(nb: NotebookNode, cwd: Path, full: bool, timeout_s: int) -> tuple[str | None, float]:
    """Run ``nb`` in place in its folder; ``(error or None, seconds)`` (outputs kept on failure)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from nbconvert.filters import strip_ansi

    env = dict(os.environ, GRPO_NB_SMOKE="0" if full else "1")
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    start = time.monotonic()
    try:
        client.execute(env=env)
        error = None
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
        last_line = strip_ansi(str(exc)).strip().splitlines()[-1]
        error = f"{type(exc).__name__}: {last_line[:300]}"
    return error, time.monotonic() - start


def _leaf_html(name: str, st: dict[str, Any]) -> str:
    """A control as static HTML: its text, a progress bar, or ``[label: value]``."""
    if name in {"HTMLModel", "HTMLMathModel", "LabelModel"}:
        return str(st.get("value", ""))
    if name in {"FloatProgressModel", "IntProgressModel"}:
        return f'<progress value="{st.get("value", 0)}" max="{st.get("max", 100)}"></progress>'
    label = st.get("description") or name.removesuffix("Model")
    return html.escape(f"[{label}: {st['value']}]" if "value" in st else f"[{label}]")


def _widget_outputs(model_id: str, state: dict[str, Any], depth: int = 0) -> list[dict[str, Any]]:
    """Static outputs standing in for one widget view (recursing into boxes and Output)."""
    model = state.get(model_id)
    if model is None or depth > 20:
        return []
    name, st = model.get("model_name", ""), model.get("state", {})
    if name == "OutputModel":
        return _flatten_outputs(st.get("outputs", []), state, depth + 1)
    if "children" not in st:
        return [nbformat.v4.new_output("display_data", data={"text/html": _leaf_html(name, st)})]
    children = [state.get(str(c).removeprefix("IPY_MODEL_"), {}) for c in st["children"]]
    leaves = all("children" not in c.get("state", {}) and c.get("model_name") != "OutputModel"
                 for c in children)
    if name == "HBoxModel" and leaves:
        # a row of controls, such as tqdm's bar: one line, as in JupyterLab
        row = " ".join(_leaf_html(c.get("model_name", ""), c.get("state", {})) for c in children)
        html_row = f'<div style="display:flex;gap:.6em;align-items:center">{row}</div>'
        return [nbformat.v4.new_output("display_data", data={"text/html": html_row})]
    return [out for child in st["children"]  # VBox, interact's container: each child in turn
            for out in _widget_outputs(str(child).removeprefix("IPY_MODEL_"), state, depth + 1)]


def _flatten_outputs(outputs: list[Any], state: dict[str, Any], depth: int) -> list[Any]:
    flat = []
    for out in outputs:
        view = out.get("data", {}).get(WIDGET_VIEW)
        if view is None:
            flat.append(out)
            continue
        for inner in _widget_outputs(view.get("model_id", ""), state, depth):
            if "metadata" in inner:  # stream outputs have no metadata in the schema
                inner = {**inner, "metadata": {**inner["metadata"], FROM_WIDGET: True}}
            flat.append(inner)
    return flat


def flatten_widgets(nb: NotebookNode) -> NotebookNode:
    """Replace widget views by the outputs they showed (no widget manager from a CDN needed)."""
    out = copy.deepcopy(nb)
    state = out.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(o) for o in _flatten_outputs(cell.outputs, state, 0)]
    out.metadata.pop("widgets", None)
    return out


def ship_mathjax(dest: Path, source: Path = LOCAL_MATHJAX.parent) -> str:
    """Copy MathJax's browser files into ``dest``; the relative URL pages load it by."""
    if not (source / "MathJax.js").is_file():
        raise FileNotFoundError(f"no MathJax at {source}: apt-get install libjs-mathjax "
                                "(make system-deps does it)")
    shutil.rmtree(dest, ignore_errors=True)
    for part in MATHJAX_PARTS:
        src, out = source / part, dest / part
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, symlinks=False)  # Debian links fonts from other packages
        else:
            shutil.copyfile(src, out)
    return f"{dest.name}/MathJax.js?config={MATHJAX_CONFIG}"


def render_html(nb: NotebookNode, mathjax_url: str | None, template: str = "lab") -> str:
    """One self-contained page loading MathJax from ``mathjax_url`` (None: nbconvert's CDN)."""
    from nbconvert import HTMLExporter

    extra = {"mathjax_url": mathjax_url} if mathjax_url else {}
    exporter = HTMLExporter(template_name=template, embed_images=True, **extra)
    body, _ = exporter.from_notebook_node(nb)
    return body


def chromium_executable() -> str:
    """Debian's Chromium (``GRPO_NB_CHROMIUM`` overrides); Playwright's own is never used."""
    path = os.environ.get("GRPO_NB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        raise FileNotFoundError(f"no Chromium at {path}: apt-get install chromium (make test does)")
    return path


def print_pdf(html_path: Path, pdf_path: Path) -> None:
    """Print an HTML file to PDF with the system Chromium, once MathJax has typeset it."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=chromium_executable(),
                                                    headless=True, args=CHROMIUM_ARGS)
        try:
            page = ctx.new_page()
            page.emulate_media(media="print")
            # "load", not "networkidle": scripts from a CDN may never answer offline.
            page.goto(html_path.resolve().as_uri(), wait_until="load", timeout=120_000)
            try:
                page.wait_for_function("() => window.MathJax && window.MathJax.Hub", timeout=5_000)
                page.evaluate("() => new Promise(done => window.MathJax.Hub.Queue(done))")
                page.wait_for_timeout(300)
            except PlaywrightTimeout:
                pass  # no MathJax: formulas stay as TeX source, still readable
            page.pdf(path=str(pdf_path), print_background=True, format="A4")
        finally:
            ctx.close()
