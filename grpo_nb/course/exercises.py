"""Exercise checkers: ``check("03_ex1", sign_problems, globals(), "fixed_loss")`` runs a checker
(a list of what is wrong) on the learner's answer and prints ✓ or ✗ without raising. With
``GRPO_NB_SOLUTIONS=1`` (CI) it first runs ``solutions/<exercise>.py`` and a failure raises.
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


def load_solution(exercise: str, namespace: dict[str, Any], folder: Path = SOLUTIONS) -> None:
    """Execute ``solutions/<exercise>.py`` in ``namespace`` (the notebook's globals)."""
    path = folder / f"{exercise}.py"
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)


def check(
    exercise: str,
    checker: Callable[[Any], Problems | Awaitable[Problems]],
    namespace: dict[str, Any],
    answer: str,
) -> Coroutine[Any, Any, None] | None:
    """Run ``checker(namespace[answer])``, print ✓ or ✗; an async checker gives an awaitable."""
    strict = env_flag("GRPO_NB_SOLUTIONS")  # CI: run the shipped solution, and enforce it
    if strict:
        load_solution(exercise, namespace)
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
    path = SOLUTIONS / f"{exercise}.py"
    shown = "\n".join(f"  - {p}" for p in problems[:5])
    more = f"\n  … and {len(problems) - 5} more" if len(problems) > 5 else ""
    if strict:
        raise AssertionError(f"{path} fails its checker:\n{shown}{more}")
    print(f"✗ {exercise}: not yet\n{shown}{more}\n"
          f"  Stuck? `%load {path}` in a new cell loads the solution.")
