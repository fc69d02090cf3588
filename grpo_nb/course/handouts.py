"""Workshop handouts: student copies, executed HTML pages with an index, and an optional PDF.
Notebooks tag cells ``exercise`` / ``solution`` (paired in order) and state their runtime in the
opening markdown, e.g. ``**Time:** smoke ~1 min · full ~5 min``.
"""

from __future__ import annotations

import argparse
import copy
import html
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from grpo_nb.config import repo_root
from grpo_nb.course.handouts_render import (
    execute,
    flatten_widgets,
    print_pdf,
    render_html,
    ship_mathjax,
)

SOLUTION_TAG = "solution"
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


@dataclass(frozen=True)
class Runtime:
    """How long a notebook says it takes, as written (e.g. ``"~1 min"``)."""

    smoke: str
    full: str


@dataclass
class HandoutConfig:
    """What to build, from where, into where; ``only`` lists notebook numbers (empty: all)."""

    notebooks: Path
    out: Path
    full: bool = False  # the full-size configuration instead of GRPO_NB_SMOKE=1
    pdf: bool = False
    solutions: bool = False  # keep them in the pages (an instructor's copy)
    only: tuple[str, ...] = ()
    cell_timeout_s: int | None = None  # None: 600 s in smoke mode, 3600 s in full mode

    def __post_init__(self) -> None:
        self.notebooks, self.out = Path(self.notebooks), Path(self.out)
        if not self.notebooks.is_dir():
            raise ValueError(f"notebooks: {self.notebooks} is not a folder")
        if self.cell_timeout_s is None:
            self.cell_timeout_s = 3600 if self.full else 600
        if self.cell_timeout_s <= 0:
            raise ValueError(f"cell_timeout_s must be positive, got {self.cell_timeout_s}")
        if any(not re.fullmatch(r"\d\d", p) for p in self.only):
            raise ValueError(f"only: expected two-digit notebook numbers, got {self.only}")


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
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if first is None:
        return None
    for para in re.split(r"\n\s*\n", first.source):
        if not re.match(r"\s*\*\*Time:?\*\*", para, re.I):
            continue
        text = re.sub(r"`[^`]*`|\([^)]*\)", " ", " ".join(para.split()))
        parts: dict[str, str] = {}
        for pattern in (_MODE_THEN_TIME, _TIME_THEN_MODE):
            for m in pattern.finditer(text):
                parts.setdefault(m["mode"].lower(), _tidy_duration(m["value"]))
        if "smoke" in parts and "full" in parts:
            return Runtime(smoke=parts["smoke"], full=parts["full"])
    return None


def _tidy_duration(text: str) -> str:
    text = re.sub(r"^(?:about\s+|[~≈]\s*)", "~", " ".join(text.split()))
    return re.sub(r"\bminutes?\b", "min", re.sub(r"\bseconds?\b", "s", text))


def notebook_title(nb: NotebookNode, fallback: str) -> str:
    """The first markdown heading, which every course notebook opens with."""
    headings = (line.lstrip("#").strip() for cell in nb.cells if cell.cell_type == "markdown"
                for line in cell.source.splitlines() if line.startswith("#"))
    return next(headings, fallback)


def student_copy(nb: NotebookNode) -> NotebookNode:
    """The notebook without its solution cells and without any outputs or widget state."""
    out = _without_solutions(nb)
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    out.metadata.pop("widgets", None)
    return out


def index_html(pages: list[PageResult], cfg: HandoutConfig, out: Path) -> str:
    """The index: notebooks in order, with links, stated runtimes and this build's outcome."""
    mode = "full" if cfg.full else "smoke (GRPO_NB_SMOKE=1)"
    rows = []
    for p in pages:

        def link(key: str, p: PageResult = p) -> str:
            if key not in p.files:
                return "—"
            return f'<a href="{html.escape(p.files[key].relative_to(out).as_posix())}">{key}</a>'

        stated = f"smoke {p.runtime.smoke} · full {p.runtime.full}" if p.runtime else "not stated"
        status = "ok" if p.error is None else f"FAILED: {html.escape(p.error)}"
        rows.append(
            f"<tr><td>{html.escape(p.name[:2])}</td><td>{html.escape(p.title)}</td>"
            f"<td>{link('page')} · {link('notebook')}</td><td>{html.escape(stated)}</td>"
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
        page = PageResult(path.name, notebook_title(nb, path.stem), parse_runtime(nb))
        pages.append(page)
        page.files["notebook"] = student_dir / path.name
        nbformat.write(student_copy(nb), page.files["notebook"])
        print(f"[handouts] running {path.name} ({'full' if cfg.full else 'smoke'}) …", flush=True)
        page.error, page.seconds = execute(nb, path.parent, cfg.full, cfg.cell_timeout_s or 600)
        page.shown = flatten_widgets(nb if cfg.solutions else _without_solutions(nb))
        page.files["page"] = html_dir / f"{path.stem}.html"
        page.files["page"].write_text(render_html(page.shown, mathjax), encoding="utf-8")
        print(f"[handouts]   {page.seconds:.0f} s, {page.error or 'ok'}", flush=True)
    if cfg.pdf and pages:
        combined = html_dir / "all-pages.html"  # next to the MathJax copy its URL names
        shown = _combine([p.shown for p in pages])
        combined.write_text(render_html(shown, mathjax, template="webpdf"), encoding="utf-8")
        print_pdf(combined, cfg.out / PDF_NAME)
        combined.unlink()
    (cfg.out / "index.html").write_text(index_html(pages, cfg, cfg.out), encoding="utf-8")
    return pages


def _without_solutions(nb: NotebookNode) -> NotebookNode:
    out = copy.deepcopy(nb)
    out.cells = [c for c in out.cells if SOLUTION_TAG not in cell_tags(c)]
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


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
