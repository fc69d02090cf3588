"""Handouts: student copies without solutions, executed HTML pages with plots, index, PDF.

The builder runs once on two fixture notebooks (one good, one failing) written to tmp_path;
the course notebooks in notebooks/ are checked for the conventions the builder relies on
(exercise/solution tags, the stated runtime) without executing them — `make handouts` does that.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from browser_helpers import FIXTURE_SOLUTION, fixture_notebook, offline_typeset

from grpo_nb.course import doctor, handouts
from grpo_nb.course.handouts import FROM_WIDGET, WIDGET_VIEW

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
OUTPUT_IMAGE = re.compile(
    r'<div class="jp-RenderedImage[^>]*>\s*<img[^>]*src="data:image/png;base64,'
)


def _md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text)])


def _tagged(*specs: tuple[str, str]) -> nbformat.NotebookNode:
    """A notebook of code/markdown cells with one tag each ("" = untagged)."""
    cells = []
    for kind, tag in specs:
        cell = (
            nbformat.v4.new_code_cell("x = 1")
            if kind == "code"
            else nbformat.v4.new_markdown_cell("q")
        )
        if tag:
            cell.metadata["tags"] = [tag]
        cells.append(cell)
    return nbformat.v4.new_notebook(cells=cells)


def exercise_problems(nb: nbformat.NotebookNode) -> list[str]:
    """Why the notebook's exercise and solution cells do not pair up (empty when they do)."""
    problems = []
    tags = [handouts.cell_tags(c) for c in nb.cells]
    both = [i for i, t in enumerate(tags) if {"exercise", "solution"} <= t]
    if both:
        problems.append(f"cells {both} are tagged both exercise and solution")
    ex_any = [i for i, t in enumerate(tags) if "exercise" in t]
    sol_all = [i for i, t in enumerate(tags) if "solution" in t]
    ex_code = [i for i in ex_any if nb.cells[i].cell_type == "code"]
    sol_code = [i for i in sol_all if nb.cells[i].cell_type == "code"]
    if len(sol_code) < len(ex_code):
        problems.append(f"{len(ex_code)} exercise code cells but {len(sol_code)} solution code "
                        "cells")
    for k, (ex, sol) in enumerate(zip(ex_code, sol_code, strict=False)):
        if sol < ex:
            problems.append(f"solution #{k + 1} (cell {sol}) comes before exercise #{k + 1} "
                            f"(cell {ex})")
    if ex_any and not any(s > ex_any[0] for s in sol_all):
        problems.append("exercises without any solution cell after them")
    return problems


def solution_leaks(source: nbformat.NotebookNode, student: nbformat.NotebookNode) -> list[str]:
    """Lines written only in solution cells that appear in the student copy."""
    public: set[str] = set()
    secret: set[str] = set()
    for cell in source.cells:
        lines = {ln.strip() for ln in cell.source.splitlines() if len(ln.strip()) > 3}
        (secret if "solution" in handouts.cell_tags(cell) else public).update(lines)
    secret -= public
    student_text = "\n".join(c.source for c in student.cells)
    student_lines = {ln.strip() for ln in student_text.splitlines()}
    return sorted(secret & student_lines)


def test_parse_runtime_reads_the_agreed_line() -> None:
    rt = handouts.parse_runtime(_md("# T\n\nLearn things.\n\n**Time:** smoke ~1 min · full ~5 min"))
    assert rt == handouts.Runtime(smoke="~1 min", full="~5 min")
    rt = handouts.parse_runtime(_md("**Time**: smoke: 30 s, full: 10–15 min"))
    assert rt == handouts.Runtime(smoke="30 s", full="10–15 min")
    rt = handouts.parse_runtime(
        _md("**Time:** about 15 s to run in smoke mode, 2 min in full mode")
    )
    assert rt == handouts.Runtime(smoke="~15 s", full="2 min")
    wrapped = "**Time:** smoke (`GRPO_NB_SMOKE=1`, CI) ≈ 3–5 min;\nfull mode ≈ 20 minutes.\n\nMore."
    assert handouts.parse_runtime(_md(wrapped)) == handouts.Runtime(
        smoke="~3–5 min", full="~20 min"
    )
    assert handouts.parse_runtime(_md("**Time:** smoke ~1 min\n\nfull ~5 min")) is None  # 2 paras
    assert handouts.parse_runtime(_md("# T\n\nno runtime here")) is None
    assert handouts.parse_runtime(_md("**Time:** about 5 min")) is None  # both modes required


def test_exercise_pairing_rules() -> None:
    ok_interleaved = _tagged(("markdown", "exercise"), ("code", "exercise"), ("code", "solution"))
    ok_at_end = _tagged(
        ("code", "exercise"), ("code", "exercise"), ("code", "solution"), ("code", "solution")
    )
    assert exercise_problems(ok_interleaved) == []
    assert exercise_problems(ok_at_end) == []
    missing = exercise_problems(
        _tagged(("code", "exercise"), ("code", "exercise"), ("code", "solution"))
    )
    assert any("2 exercise code cells but 1 solution" in p for p in missing)
    early = exercise_problems(_tagged(("code", "solution"), ("code", "exercise")))
    assert any("comes before" in p for p in early)
    talk_only = exercise_problems(_tagged(("markdown", "exercise"), ("code", "")))
    assert talk_only == ["exercises without any solution cell after them"]


def test_student_copy_drops_solutions_and_outputs() -> None:
    nb = fixture_notebook()
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="leaked output")]
    student = handouts.student_copy(nb)
    text = "\n".join(c.source for c in student.cells)
    assert FIXTURE_SOLUTION not in text and "TODO: your code here" in text
    assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")
    assert len(student.cells) == len(nb.cells) - 1
    # the leak detector sees a solution pasted into an untagged cell
    student.cells.append(nbformat.v4.new_code_cell(f"def double(x):\n    {FIXTURE_SOLUTION}"))
    assert solution_leaks(nb, student) == [FIXTURE_SOLUTION]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """One build of two fixture notebooks (a good one and a failing one), with the PDF."""
    src, out = tmp_path_factory.mktemp("nbs"), tmp_path_factory.mktemp("handouts")
    nbformat.write(fixture_notebook(steps=3), src / "01_fixture.ipynb")
    nbformat.write(fixture_notebook(steps=1, fail=True), src / "02_broken.ipynb")
    nbformat.write(fixture_notebook(), src / "notes.ipynb")  # not NN_*: not a course notebook
    rc = handouts.cli(
        ["--notebooks", str(src), "--out", str(out), "--pdf", "--cell-timeout", "120"]
    )
    return rc, out


def test_build_writes_student_copies_without_solutions(built: tuple[int, Path]) -> None:
    _, out = built
    assert sorted(p.name for p in (out / "student").iterdir()) == [
        "01_fixture.ipynb",
        "02_broken.ipynb",
    ]
    student = nbformat.read(out / "student" / "01_fixture.ipynb", as_version=4)
    raw = (out / "student" / "01_fixture.ipynb").read_text()
    assert "2 * x" not in raw and "secret solution" not in raw
    assert [handouts.cell_tags(c) for c in student.cells].count({"exercise"}) == 2


def test_build_pages_show_final_plots_as_images(built: tuple[int, Path]) -> None:
    _, out = built
    page = (out / "html" / "01_fixture.html").read_text()
    # the live plot's last frame ("step 2") and the plot drawn inside the slider's Output widget
    assert len(OUTPUT_IMAGE.findall(page)) == 2
    assert "[eps: 0.2]" in page  # the slider, as static text
    row = re.search(r'align-items:center">steps <progress ([^>]*)></progress></div>', page)
    assert row and sorted(row[1].split()) == ['max="5"', 'value="3"']  # a tqdm-like row, one line
    assert WIDGET_VIEW not in page and "Loading widget" not in page
    assert "self-check passed" in page
    assert "secret solution" not in page  # pages leave solutions out unless --solutions


def test_build_index_lists_pages_in_order_with_runtimes(built: tuple[int, Path]) -> None:
    rc, out = built
    assert rc == 1  # one notebook failed
    index = (out / "index.html").read_text()
    assert index.index('href="html/01_fixture.html"') < index.index('href="html/02_broken.html"')
    assert index.count("smoke ~1 min · full ~2 min") == 2
    assert "FAILED: CellExecutionError: RuntimeError: fixture failure" in index
    assert "notes.html" not in index
    broken = (out / "html" / "02_broken.html").read_text()
    assert "fixture failure" in broken  # the page shows the traceback


def test_pages_typeset_formulas_offline(built: tuple[int, Path]) -> None:
    """The handout folder alone, network cut off: MathJax comes from html/mathjax/ by a relative
    URL and turns every formula into typeset output; no raw TeX is left on the page."""
    _, out = built
    page = out / "html" / "01_fixture.html"
    src = page.read_text()
    assert 'src="mathjax/MathJax.js?config=' in src and "libs/mathjax" not in src
    assert "/usr/share" not in src  # nothing points into this machine's file system
    seen = offline_typeset(page)
    assert seen["loaded"], f"MathJax did not load offline; blocked requests: {seen['blocked']}"
    assert seen["typeset"] >= 2 and seen["errors"] == 0, seen  # the inline and the display one
    assert seen["raw_tex"] == [], seen


def test_offline_check_sees_raw_tex_without_local_mathjax(built: tuple[int, Path]) -> None:
    # The same page pointing at a CDN (nbconvert's default) shows TeX source offline: the check
    # above would fail on it. MathJax is a plain <script>: by the page's load it has run or
    # failed, so a short wait does not make this pass where the long one would fail.
    _, out = built
    src = (out / "html" / "01_fixture.html").read_text()
    cdn = out / "html" / "cdn_copy.html"
    cdn.write_text(src.replace("mathjax/MathJax.js?", "https://cdn.invalid/MathJax.js?"))
    try:
        seen = offline_typeset(cdn, wait_s=2.0)
    finally:
        cdn.unlink()
    assert not seen["loaded"] and seen["typeset"] == 0
    assert "$$" in seen["raw_tex"] and any(u.startswith("https://cdn.invalid") for u in seen["blocked"])


def test_readiness_check_prints_one_line_and_returns_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The first cell of every notebook ends with check("NN"): whatever it returns is displayed
    # under the line, so it must return None (not a Report with its field dump).
    assert doctor.check("03") is None
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[doctor 03] python ") and "mode" in lines[0]
    shown = repr(doctor.diagnose())  # a cell that does end with a Report shows one short line
    assert "\n" not in shown and "versions=" not in shown and len(shown) < 200
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        first = next(c for c in nb.cells if c.cell_type == "code")
        assert first.source.strip().splitlines()[-1] == f'check("{path.name[:2]}")'


def test_build_prints_one_pdf(built: tuple[int, Path]) -> None:
    _, out = built
    pdf = (out / handouts.PDF_NAME).read_bytes()
    assert pdf.startswith(b"%PDF-")
    assert len(re.findall(rb"/Type\s*/Page\b", pdf)) >= 2  # the second notebook starts a page
    assert len(re.findall(rb"/Subtype\s*/Image", pdf)) >= 2
    # formulas typeset offline by Debian's MathJax (libjs-mathjax, installed by the Makefile)
    assert b"MathJax_Main" in pdf


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_course_notebook_conventions(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert handouts.parse_runtime(nb) is not None, (
        "opening markdown needs a line like '**Time:** smoke ~1 min · full ~5 min'"
    )
    assert any("exercise" in handouts.cell_tags(c) for c in nb.cells), "no cell tagged exercise"
    assert exercise_problems(nb) == []
    student = handouts.student_copy(nb)
    assert solution_leaks(nb, student) == []
    # a solution left untagged would reach students: flag headings/comments that announce one
    announced = [
        c.source[:60]
        for c in student.cells
        if re.search(r"^\s*(#+\s*|\*\*)solution", c.source, re.IGNORECASE | re.MULTILINE)
    ]
    assert announced == [], f"untagged cells announce a solution: {announced}"


def _readme_times() -> dict[str, tuple[str, str]]:
    """The README's notebook table: number -> (smoke, full) as written, notes in () dropped."""
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        m = re.match(r"\|\s*`(\d\d)_[^|]*\|[^|]*\|([^|]*)\|([^|]*)\|\s*$", line)
        if m:
            rows[m[1]] = tuple(re.sub(r"\([^)]*\)", "", c).strip() for c in (m[2], m[3]))
    return rows


def test_readme_table_states_the_notebooks_own_times() -> None:
    # One source of truth: each notebook's **Time:** line; the README's table must repeat it.
    readme = _readme_times()
    assert sorted(readme) == [p.name[:2] for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        stated = handouts.parse_runtime(nbformat.read(path, as_version=4))
        assert stated is not None
        assert readme[path.name[:2]] == (stated.smoke, stated.full), (
            f"README.md's row for {path.name} says {readme[path.name[:2]]}, the notebook says "
            f"{stated}: copy the notebook's **Time:** line into the table"
        )


@pytest.mark.parametrize("number", ["01", "02", "03", "04", "05", "06"])
def test_notebook_opens_with_prerequisites_goals_and_time(number: str) -> None:
    (path,) = [p for p in NOTEBOOKS if p.name.startswith(number)]
    opening = nbformat.read(path, as_version=4).cells[0].source
    for heading in ("**Prerequisites**", "**What you will learn**", "**Time:**"):
        assert heading in opening, f"{path.name}: the opening cell lacks {heading}"
    assert opening.index("**Prerequisites**") < opening.index("**What you will learn**")


@pytest.mark.slow
def test_real_notebook_page_shows_every_plot(tmp_path: Path) -> None:
    """The real pipeline on a real notebook's first sections (03 up to its toy-ring runs, ~10 s;
    the browser test runs all of 03): every image it drew is on its page, including the plot
    under its sliders, which lives inside an ipywidgets Output widget."""
    (path,) = [p for p in NOTEBOOKS if p.name.startswith("03_")]
    nb = nbformat.read(path, as_version=4)
    nb.cells = nb.cells[:next(i for i, c in enumerate(nb.cells) if c.source.startswith("## 8 "))]
    folder = tmp_path / "notebooks"
    folder.mkdir()
    nbformat.write(nb, folder / path.name)
    cfg = handouts.HandoutConfig(notebooks=folder, out=tmp_path / "out", only=("03",))
    (page,) = handouts.build(cfg)
    assert page.error is None
    assert page.shown is not None
    images = [
        o
        for c in page.shown.cells
        for o in c.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]
    drawn = len(images)
    assert any(o.metadata.get(FROM_WIDGET) for o in images), "no plot from under the sliders"
    html_page = page.files["page"].read_text()
    assert "Report(" not in html_page  # the readiness cell shows its line, not a repr
    seen = offline_typeset(page.files["page"])
    assert seen["loaded"] and seen["typeset"] >= 10 and seen["raw_tex"] == [], seen
    assert drawn >= 3
    assert len(OUTPUT_IMAGE.findall(html_page)) == drawn
    assert WIDGET_VIEW not in html_page
