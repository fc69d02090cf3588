"""Exercise checkers for the notebooks: they test the learner's code, not the shipped solution.

A notebook's exercise is a stub cell the learner completes, then a checker cell::

    exercises.check("03_ex1", sign_problems, globals(), "fixed_loss")

``check`` calls the checker on the learner's answer (``namespace["fixed_loss"]``); a checker
returns the list of what is wrong, empty when the answer is right. Solutions live beside the
notebooks in ``solutions/<exercise>.py``, one deliberate step away (``%load solutions/03_ex1.py``
in a cell), so "Run all" never runs them. Two modes:

- learning (default): a wrong or unwritten answer prints ✗ and what is wrong, and raises
  nothing, so the rest of the notebook still runs;
- CI (``GRPO_NB_SOLUTIONS=1``, set by ``make nbtest`` and the browser test): the solution file
  is executed into the notebook's namespace first, and a failing check raises, so every
  solution is run through its checker.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from grpo_nb.config import env_flag

# The kernel's working directory is the notebook's folder (JupyterLab, nbmake, nbclient).
SOLUTIONS = Path("solutions")
Problems = list[str]


def solutions_mode() -> bool:
    """True when ``GRPO_NB_SOLUTIONS`` asks checkers to run (and enforce) the shipped solutions."""
    return env_flag("GRPO_NB_SOLUTIONS")


def solution_path(exercise: str, folder: Path | None = None) -> Path:
    return (folder or SOLUTIONS) / f"{exercise}.py"


def load_solution(exercise: str, namespace: dict[str, Any], folder: Path | None = None) -> None:
    """Execute ``solutions/<exercise>.py`` in ``namespace`` (the notebook's globals)."""
    path = solution_path(exercise, folder)
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)


def check(
    exercise: str,
    checker: Callable[[Any], Problems | Awaitable[Problems]],
    namespace: dict[str, Any],
    answer: str,
    folder: Path | None = None,
) -> Coroutine[Any, Any, None] | None:
    """Run ``checker(namespace[answer])`` and print ✓ or ✗; an async checker gives an awaitable.

    In CI mode the solution is loaded first and a failure raises ``AssertionError``.
    """
    strict = solutions_mode()
    if strict:
        load_solution(exercise, namespace, folder)
    if answer not in namespace:
        return _report(exercise, [f"`{answer}` is not defined: run the exercise cell"], strict)
    try:
        result = checker(namespace[answer])
    except Exception as err:  # the learner's code may raise anything; it is a finding
        return _report(exercise, _raised(err), strict)
    if not inspect.isawaitable(result):
        return _report(exercise, result, strict)

    async def finish(pending: Awaitable[Problems]) -> None:
        try:
            problems = await pending
        except Exception as err:
            problems = _raised(err)
        return _report(exercise, problems, strict)

    return finish(result)


def _raised(err: Exception) -> Problems:
    if isinstance(err, NotImplementedError):
        return ["not written yet (the exercise cell still raises NotImplementedError)"]
    first = str(err).strip().splitlines()[:1] or [""]  # an ActorError carries a traceback
    return [f"your code raised {type(err).__name__}: {first[0]}"]


def _report(exercise: str, problems: Problems, strict: bool) -> None:
    if not problems:
        print(f"✓ {exercise}: correct" + (" (the shipped solution)" if strict else ""))
        return
    shown = "\n".join(f"  - {p}" for p in problems[:5])
    more = f"\n  … and {len(problems) - 5} more" if len(problems) > 5 else ""
    if strict:
        raise AssertionError(f"{solution_path(exercise)} fails its checker:\n{shown}{more}")
    print(f"✗ {exercise}: not yet\n{shown}{more}\n"
          f"  Stuck? `%load {solution_path(exercise)}` in a new cell loads the solution.")
