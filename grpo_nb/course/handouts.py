"""Workshop handouts: student copies, executed HTML pages with an index, and an optional PDF.
Notebooks tag cells ``exercise`` / ``solution`` (paired in order) and state their runtime in the
opening markdown, e.g. ``**Time:** smoke ~1 min · full ~5 min``. Pages load Debian's MathJax
copied beside them (offline); Debian's Chromium prints the PDF through Playwright (nbconvert's
``WebPDFExporter`` would download a browser).
"""

from __future__ import annotations

import argparse
import copy
import html
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode

from grpo_nb.config import PosInt, check_fields, repo_root

PDF_NAME = "grpo-notebooks.pdf"
_DURATION = (
    r"(?P<value>(?:about\s+|[~≈<>]\s*)?\d[\d.,]*(?:\s*[–-]\s*\d[\d.,]*)?"
    r"\s*(?:s|secs?|seconds?|min|mins|minutes?|h|hours?)\b)"
)
# "smoke ~1 min", "smoke mode: 30 s", "full ≈ 6–10 min"
_MODE_THEN_TIME = re.compile(r"\b(?P<mode>smoke|full)(?:\s+mode)?\s*:?\s*" + _DURATION, re.I)
# "about 45 s in smoke mode", "15 s to run in smoke mode"
_TIME_THEN_MODE = re.compile(_DURATION + r"\s+(?:to\s+run\s+)?in\s+(?P<mode>smoke|full)\b", re.I)
_NOTEBOOK_NAME = re.compile(r"^\d\d_.+\.ipynb$")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
FROM_WIDGET = "grpo_nb_from_widget"  # output metadata flag: this output was inside a widget
MATHJAX_DIR = Path("/usr/share/javascript/mathjax")  # Debian's libjs-mathjax
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


@dataclass(frozen=True)
class Runtime:
    """How long a notebook says it takes, as written (e.g. ``"~1 min"``)."""

    smoke: str
    full: str


@dataclass
class HandoutConfig:
    """What to build, from where, into where; ``only`` lists notebook numbers (empty: all)."""

    notebooks: Path  # the folder of NN_*.ipynb notebooks
    out: Path  # where the pages go
    full: bool = False  # the full-size configuration instead of GRPO_NB_SMOKE=1
    pdf: bool = False  # also a PDF of each page
    solutions: bool = False  # keep them in the pages (an instructor's copy)
    only: tuple[str, ...] = ()  # two-digit notebook numbers
    cell_timeout_s: PosInt | None = None  # None: 600 s in smoke mode, 3600 s in full mode

    def __post_init__(self) -> None:
        self.notebooks, self.out, self.only = Path(self.notebooks), Path(self.out), tuple(self.only)
        check_fields(self)
        if not self.notebooks.is_dir():
            raise ValueError(f"HandoutConfig.notebooks={str(self.notebooks)!r}: not a folder")
        if self.cell_timeout_s is None:
            self.cell_timeout_s = 3600 if self.full else 600
        if any(not re.fullmatch(r"\d\d", p) for p in self.only):
            raise ValueError(f"HandoutConfig.only={self.only}: use two-digit notebook numbers")


@dataclass
class PageResult:
    """One notebook's outcome on the index page; ``shown``: the executed notebook rendered."""

    name: str
    title: str
    runtime: Runtime | None
    seconds: float = 0.0
    error: str | None = None
    files: dict[str, Path] = field(default_factory=dict)
    shown: NotebookNode | None = None


def cell_tags(cell: NotebookNode) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def parse_runtime(nb: NotebookNode) -> Runtime | None:
    """The runtimes (both modes) the opening markdown's ``**Time:**`` paragraph states, if any."""
    first = next((c.source for c in nb.cells if c.cell_type == "markdown"), "")
    for para in re.split(r"\n\s*\n", first):
        if not re.match(r"\s*\*\*Time:?\*\*", para, re.I):
            continue
        text = re.sub(r"`[^`]*`|\([^)]*\)", " ", " ".join(para.split()))
        parts: dict[str, str] = {}
        for pattern in (_MODE_THEN_TIME, _TIME_THEN_MODE):
            for m in pattern.finditer(text):
                value = re.sub(r"^(?:about\s+|[~≈]\s*)", "~", " ".join(m["value"].split()))
                value = re.sub(r"\bminutes?\b", "min", re.sub(r"\bseconds?\b", "s", value))
                parts.setdefault(m["mode"].lower(), value)
        if "smoke" in parts and "full" in parts:
            return Runtime(smoke=parts["smoke"], full=parts["full"])
    return None


def student_copy(nb: NotebookNode) -> NotebookNode:
    """The notebook without its solution cells and without any outputs or widget state."""
    out = _without_solutions(nb)
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    out.metadata.pop("widgets", None)
    return out


def index_html(pages: list[PageResult], cfg: HandoutConfig) -> str:
    """The index: notebooks in order, with links, stated runtimes and this build's outcome."""
    mode = "full" if cfg.full else "smoke (GRPO_NB_SMOKE=1)"
    rows = []
    for p in pages:
        links = " · ".join(f'<a href="{html.escape(f.relative_to(cfg.out).as_posix())}">{key}</a>'
                           for key, f in p.files.items())
        stated = f"smoke {p.runtime.smoke} · full {p.runtime.full}" if p.runtime else "not stated"
        status = "ok" if p.error is None else f"FAILED: {html.escape(p.error)}"
        rows.append(
            f"<tr><td>{html.escape(p.name[:2])}</td><td>{html.escape(p.title)}</td>"
            f"<td>{links}</td><td>{html.escape(stated)}</td>"
            f"<td>{p.seconds:.0f} s</td><td>{status}</td></tr>"
        )
    extra = f' · <a href="{PDF_NAME}">all pages as one PDF</a>' if cfg.pdf else ""
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>GRPO notebooks</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:.3em .8em;"
        "border-bottom:1px solid #ddd;text-align:left}</style></head><body>"
        f"<h1>GRPO notebooks — workshop handouts</h1><p>Pages executed in {mode} mode"
        f"{' with solutions' if cfg.solutions else ', solutions left out'}{extra}.</p>"
        "<table><tr><th>#</th><th>notebook</th><th>open</th><th>stated runtime</th>"
        "<th>this build</th><th>status</th></tr>" + "".join(rows) + "</table></body></html>"
    )


def build(cfg: HandoutConfig) -> list[PageResult]:
    """Write the student copies, the HTML pages, the index and (optionally) the PDF."""
    student_dir, html_dir = cfg.out / "student", cfg.out / "html"
    for folder in (student_dir, html_dir):  # no stale page of a renamed notebook survives
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    pages: list[PageResult] = []
    mathjax = ship_mathjax(html_dir / "mathjax")
    for path in sorted(cfg.notebooks.iterdir()):
        if not _NOTEBOOK_NAME.match(path.name) or (cfg.only and path.name[:2] not in cfg.only):
            continue
        nb = nbformat.read(path, as_version=4)
        # the title: the first markdown heading, which every course notebook opens with
        headings = (line.lstrip("#").strip() for cell in nb.cells if cell.cell_type == "markdown"
                    for line in cell.source.splitlines() if line.startswith("#"))
        files = {"page": html_dir / f"{path.stem}.html", "notebook": student_dir / path.name}
        page = PageResult(path.name, next(headings, path.stem), parse_runtime(nb), files=files)
        pages.append(page)
        nbformat.write(student_copy(nb), files["notebook"])
        print(f"[handouts] running {path.name} ({'full' if cfg.full else 'smoke'}) …", flush=True)
        page.error, page.seconds = execute(nb, path.parent, cfg.full, cfg.cell_timeout_s)
        page.shown = flatten_widgets(nb if cfg.solutions else _without_solutions(nb))
        files["page"].write_text(render_html(page.shown, mathjax), encoding="utf-8")
        print(f"[handouts]   {page.seconds:.0f} s, {page.error or 'ok'}", flush=True)
    if cfg.pdf and pages:
        combined = html_dir / "all-pages.html"  # next to the MathJax copy its URL names
        shown = _combine([p.shown for p in pages])
        combined.write_text(render_html(shown, mathjax, template="webpdf"), encoding="utf-8")
        print_pdf(combined, cfg.out / PDF_NAME)
        combined.unlink()
    (cfg.out / "index.html").write_text(index_html(pages, cfg), encoding="utf-8")
    return pages


def _without_solutions(nb: NotebookNode) -> NotebookNode:
    out = copy.deepcopy(nb)
    out.cells = [c for c in out.cells if "solution" not in cell_tags(c)]
    return out


def _combine(notebooks: list[NotebookNode]) -> NotebookNode:
    """All pages in one notebook, each starting on a new printed page."""
    combined = nbformat.v4.new_notebook(metadata=copy.deepcopy(notebooks[0].metadata))
    for i, nb in enumerate(notebooks):
        if i:
            combined.cells.append(nbformat.v4.new_markdown_cell(
                '<div style="break-before: page"></div>'))
        combined.cells.extend(copy.deepcopy(nb.cells))
    for i, cell in enumerate(combined.cells):  # ids must stay unique across notebooks
        cell["id"] = f"cell-{i}"
    return combined


def execute(nb: NotebookNode, cwd: Path, full: bool, timeout_s: int) -> tuple[str | None, float]:
    """Run ``nb`` in place in its folder; ``(error or None, seconds)`` (outputs kept on failure)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from nbconvert.filters import strip_ansi

    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    start = time.monotonic()
    try:
        client.execute(env=dict(os.environ, GRPO_NB_SMOKE="0" if full else "1"))
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


def ship_mathjax(dest: Path) -> str:
    """Copy MathJax's browser files into ``dest``; the relative URL pages load it by."""
    if not (MATHJAX_DIR / "MathJax.js").is_file():
        raise FileNotFoundError(f"no MathJax at {MATHJAX_DIR}: apt-get install libjs-mathjax "
                                "(make system-deps does it)")
    shutil.rmtree(dest, ignore_errors=True)
    for part in MATHJAX_PARTS:
        src, out = MATHJAX_DIR / part, dest / part
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, symlinks=False)  # Debian links fonts from other packages
        else:
            shutil.copyfile(src, out)
    return f"{dest.name}/MathJax.js?config={MATHJAX_CONFIG}"


def render_html(nb: NotebookNode, mathjax_url: str, template: str = "lab") -> str:
    """One self-contained page loading MathJax from ``mathjax_url``."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name=template, embed_images=True, mathjax_url=mathjax_url)
    return exporter.from_notebook_node(nb)[0]


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

    with sync_playwright() as pw, pw.chromium.launch(executable_path=chromium_executable(),
                                                     args=CHROMIUM_ARGS) as browser:
        page = browser.new_page()
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


def cli(argv: list[str]) -> int:
    """Build the handouts; exit 1 if a notebook failed."""
    root = repo_root() or Path.cwd()
    parser = argparse.ArgumentParser(prog="python -m grpo_nb handouts",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--notebooks", type=Path, default=root / "notebooks")
    parser.add_argument("--out", type=Path, default=root / "build" / "handouts")
    parser.add_argument("--full", action="store_true", help="full-size runs (default: smoke)")
    parser.add_argument("--pdf", action="store_true", help="also print all pages to one PDF")
    parser.add_argument("--solutions", action="store_true", help="keep solutions in the pages")
    parser.add_argument("--only", default="", help="comma-separated numbers, e.g. 02,03")
    parser.add_argument("--cell-timeout", type=int, help="seconds per cell (600 smoke, 3600 full)")
    args = parser.parse_args(argv)
    cfg = HandoutConfig(args.notebooks, args.out, args.full, args.pdf, args.solutions,
                        tuple(s for s in args.only.split(",") if s), args.cell_timeout)
    start = time.monotonic()
    pages = build(cfg)
    failed = [p.name for p in pages if p.error]
    print(f"[handouts] {len(pages)} notebooks in {time.monotonic() - start:.0f} s → "
          f"{cfg.out / 'index.html'}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed or not pages else 0
