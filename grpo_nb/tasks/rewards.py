"""Reading the answer out of a text, and rewards by configuration: ``make_reward(spec)`` →
``reward(completion_text, answer)``. A spec is a name in :data:`REWARDS`, ``"auto"`` (the
task's check), ``"module:function"``, a weighted sum (``"math+0.1*format"``) or a callable.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RewardFn = Callable[[str, str], float]
RewardTerm = str | RewardFn
RewardSpec = RewardTerm | Sequence[RewardTerm | tuple[RewardTerm, float]]

_TERM = re.compile(r"\s*(?:(?P<weight>\d+(?:\.\d*)?(?:[eE]-?\d+)?)\s*\*\s*)?(?P<name>[\w.:]+)\s*")
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
WHOLE_NUMBER = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, matching nested braces."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def after_hashes(text: str) -> str | None:
    """GSM8K's final answer: what follows the last ``####``, without thousands separators."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "") or None


def extract_answer(text: str, *, last_number: bool = True) -> str | None:
    """The answer a text gives: the whole text when it is a number, else the last
    ``\\boxed{}``, else what follows ``####``, else (``last_number``) the last number."""
    if (whole := WHOLE_NUMBER.fullmatch(text)) is not None:
        return whole.group(1)
    if (boxed := last_boxed(text)) is not None:
        return boxed
    if "####" in text or not last_number:
        return after_hashes(text)
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def exact_match(completion_text: str, answer: str) -> float:
    """1.0 when the completion is nothing but the answer (numerically equal: ``9`` = ``0009``)."""
    whole = WHOLE_NUMBER.fullmatch(completion_text)
    if whole is None:
        return float(completion_text.strip() == answer.strip())
    reference = as_number(answer)
    return float(reference is not None and float(whole.group(1)) == reference)


def math_answer(completion_text: str, answer: str) -> float:
    """1.0 when the answer read out of the text (:func:`extract_answer`) matches: numerically
    when both sides are numbers, else by math-verify's symbolic check."""
    predicted = extract_answer(completion_text)
    if predicted is None:
        return 0.0
    p, r = as_number(predicted), as_number(answer)
    if p is not None and r is not None:
        return float(p == r)
    from math_verify import parse, verify  # lazy: only LaTeX answers need it

    # math-verify times out with SIGALRM, which only the main thread may set: an actor scoring
    # in a worker thread would crash on it, so there it runs without a timeout (the ring's
    # Scorer runs a named reward on a child process's main thread: tasks.scoring).
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    # math-verify wants the gold answer in math delimiters to parse LaTeX.
    gold = parse(f"${answer}$", parsing_timeout=limit)
    guess = parse(f"${predicted}$", parsing_timeout=limit)
    return float(bool(gold) and bool(guess) and bool(verify(gold, guess, timeout_seconds=limit)))


def format_reward(completion_text: str, answer: str) -> float:
    """1.0 for a well-formed completion: a bare number or a ``\\boxed{}`` answer."""
    del answer  # the shape alone counts
    return float(WHOLE_NUMBER.fullmatch(completion_text) is not None
                 or last_boxed(completion_text) is not None)


REWARDS: dict[str, RewardFn] = {"exact": exact_match, "math": math_answer,
                                "format": format_reward}


def _resolve(term: RewardTerm, default: str = "math", *, load: bool = True) -> RewardFn | None:
    """A term's function, checked to take ``(completion_text, answer)``; ``load=False`` imports
    nothing (an import path is only checked for its spelling, and ``None`` returned)."""
    fn, name = term, getattr(term, "__name__", repr(term))
    if not callable(term):
        name = default if term == "auto" else term
        if ":" not in name:
            if name not in REWARDS:
                raise ValueError(f"reward {term!r}: unknown; use one of {sorted(REWARDS)}, 'auto', "
                                 "'module:function', or a weighted sum such as 'math+0.1*format'")
            return REWARDS[name]
        if not _IMPORT_PATH.fullmatch(name):
            raise ValueError(f"reward {term!r}: write an import path as 'module:function'")
        if not load:
            return None
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward {name!r}: cannot import it ({err})") from None
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable: {fn!r}")
    try:
        inspect.signature(fn).bind("completion", "answer")
    except TypeError as err:
        raise ValueError(f"reward {name!r} must accept (completion_text, answer): {err}") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def reward_terms(spec: RewardSpec = "auto") -> tuple[tuple[RewardTerm, float], ...]:
    """``spec`` as ``(term, weight)`` pairs, checked without importing anything."""
    if isinstance(spec, str):
        terms: list[tuple[RewardTerm, float]] = []
        for part in spec.split("+"):
            if (match := _TERM.fullmatch(part)) is None:
                raise ValueError(f"reward {spec!r}: cannot read the term {part!r}; "
                                 "write e.g. 'math+0.1*format'")
            terms.append((match["name"], float(match["weight"] or 1.0)))
    elif callable(spec):
        terms = [(spec, 1.0)]
    else:
        terms = [t if isinstance(t, tuple) else (t, 1.0) for t in spec]
    if not terms:
        raise ValueError("reward: give at least one reward term")
    for term, weight in terms:
        _resolve(term, load=False)
        if not math.isfinite(weight):
            raise ValueError(f"reward {term!r}: weight {weight} is not finite")
    return tuple(terms)


@dataclass(frozen=True)
class WeightedReward:
    """``Σ weight × term(completion_text, answer)``; picklable when its terms are names."""

    terms: tuple[tuple[RewardTerm, float], ...]
    default: str = "math"

    def __post_init__(self) -> None:
        # resolved once, not for every completion (an import path that fails, fails here)
        object.__setattr__(self, "_fns", tuple(_resolve(t, self.default) for t, _ in self.terms))

    def __call__(self, completion_text: str, answer: str) -> float:
        total = 0.0
        for (term, weight), fn in zip(self.terms, self._fns, strict=True):
            value = fn(completion_text, answer)
            try:
                total += weight * float(value)
            except (TypeError, ValueError):
                raise TypeError(f"reward {term!r} returned {value!r}, not a number") from None
        return total


def make_reward(spec: RewardSpec = "auto", *, default: str = "math") -> WeightedReward:
    """The reward a spec names (see the module docstring); ``"auto"`` means ``default``."""
    if default not in REWARDS:
        raise ValueError(f"reward default={default!r}: use one of {sorted(REWARDS)}")
    return WeightedReward(reward_terms(spec), default)
