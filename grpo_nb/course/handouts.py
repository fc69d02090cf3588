"""Workshop handouts: student copies, executed HTML pages with an index, and an optional PDF.

``python -m grpo_nb handouts [--full] [--pdf] [--solutions] [--only 02,03] [--out DIR]``

Conventions the notebooks follow (the tests check them): exercise cells carry the tag
``exercise`` and solution cells ``solution``, the i-th solution code cell after the i-th
exercise code cell; the opening markdown states the runtime on one line, e.g.
``**Time:** smoke ~1 min · full ~5 min``. Executing and rendering: :mod:`.handouts_render`.
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

EXERCISE_TAG = "exercise"
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
    """What to build, from where, into where; ``solutions`` keeps them in the pages (an
    instructor's copy), ``only`` lists notebook numbers (empty: all)."""

    notebooks: Path
    out: Path
    full: bool = False  # the full-size configuration instead of GRPO_NB_SMOKE=1
    pdf: bool = False
    solutions: bool = False
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
    """One notebook's outcome on the index page; ``shown`` is the executed notebook its page
    renders."""

    name: str
    title: str
    runtime: Runtime | None
    seconds: float = 0.0
    error: str | None = None
    files: dict[str, Path] = field(default_factory=dict)
    shown: NotebookNode | None = None


def cell_tags(cell: NotebookNode) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def find_notebooks(folder: Path, only: tuple[str, ...] = ()) -> list[Path]:
    """The course notebooks (``NN_name.ipynb``) in order, optionally only some numbers."""
    found = sorted(p for p in Path(folder).iterdir() if _NOTEBOOK_NAME.match(p.name))
    return [p for p in found if not only or p.name[:2] in only]


def parse_runtime(nb: NotebookNode) -> Runtime | None:
    """The runtimes the opening markdown's ``**Time:**`` paragraph states (both modes), if any;
    prose such as "about 45 s in smoke mode" is read too, code spans and parentheses skipped."""
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
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return fallback


def exercise_problems(nb: NotebookNode) -> list[str]:
    """Why the notebook's exercise and solution code cells do not pair up (empty when they do);
    a markdown-only exercise needs some solution cell after it."""
    problems = []
    both = [i for i, c in enumerate(nb.cells) if {EXERCISE_TAG, SOLUTION_TAG} <= cell_tags(c)]
    if both:
        problems.append(f"cells {both} are tagged both exercise and solution")
    ex_any = [i for i, c in enumerate(nb.cells) if EXERCISE_TAG in cell_tags(c)]
    sol_all = [i for i, c in enumerate(nb.cells) if SOLUTION_TAG in cell_tags(c)]
    ex_code = [i for i in ex_any if nb.cells[i].cell_type == "code"]
    sol_code = [i for i in sol_all if nb.cells[i].cell_type == "code"]
    if len(sol_code) < len(ex_code):
        problems.append(f"{len(ex_code)} exercise code cells but {len(sol_code)} solution code cells")
    for k, (ex, sol) in enumerate(zip(ex_code, sol_code, strict=False)):
        if sol < ex:
            problems.append(f"solution #{k + 1} (cell {sol}) comes before exercise #{k + 1} "
                            f"(cell {ex})")
    if ex_any and not any(s > ex_any[0] for s in sol_all):
        problems.append("exercises without any solution cell after them")
    return problems


def student_copy(nb: NotebookNode) -> NotebookNode:
    """The notebook without its solution cells and without any outputs or widget state."""
    out = _without_solutions(nb)
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    out.metadata.pop("widgets", None)
    return out


def solution_leaks(source: NotebookNode, student: NotebookNode) -> list[str]:
    """Lines written only in solution cells (not shared with the scaffold) that appear in the
    student copy."""
    public: set[str] = set()
    secret: set[str] = set()
    for cell in source.cells:
        lines = {ln.strip() for ln in cell.source.splitlines() if len(ln.strip()) > 3}
        (secret if SOLUTION_TAG in cell_tags(cell) else public).update(lines)
    secret -= public
    student_text = "\n".join(c.source for c in student.cells)
    student_lines = {ln.strip() for ln in student_text.splitlines()}
    return sorted(secret & student_lines)


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
    pages, executed = [], []
    mathjax = ship_mathjax(html_dir / "mathjax")
    for path in find_notebooks(cfg.notebooks, cfg.only):
        nb = nbformat.read(path, as_version=4)
        page = PageResult(path.name, notebook_title(nb, path.stem), parse_runtime(nb))
        pages.append(page)
        page.files["notebook"] = student_dir / path.name
        nbformat.write(student_copy(nb), page.files["notebook"])
        print(f"[handouts] running {path.name} ({'full' if cfg.full else 'smoke'}) …", flush=True)
        page.error, page.seconds = execute(nb, path.parent, cfg.full, cfg.cell_timeout_s or 600)
        page.shown = flatten_widgets(nb if cfg.solutions else _without_solutions(nb))
        executed.append(page.shown)
        page.files["page"] = html_dir / f"{path.stem}.html"
        page.files["page"].write_text(render_html(page.shown, mathjax), encoding="utf-8")
        print(f"[handouts]   {page.seconds:.0f} s, {page.error or 'ok'}", flush=True)
    if cfg.pdf and executed:
        combined = html_dir / "all-pages.html"  # next to the MathJax copy its URL names
        combined.write_text(render_html(_combine(executed), mathjax, template="webpdf"),
                            encoding="utf-8")
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
