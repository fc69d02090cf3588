"""Rewards chosen by configuration: ``make_reward(spec)`` → ``reward(completion_text, answer)``.

A spec is a built-in name (``exact``: the completion is just the number; ``math``: the
answer read out of the text; ``format``: a bare number or a ``\\boxed{}`` answer), ``"auto"``
(the task's own check), a ``"module:function"`` (survives pickling to another process by
name), a weighted sum such as ``"math+0.1*format"``, a callable, or a list of these (or of
``(term, weight)`` pairs).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_nb.tasks.answers import WHOLE_NUMBER, answers_match, as_number, extract_answer, format_ok

RewardFn = Callable[[str, str], float]
RewardTerm = str | RewardFn
RewardSpec = RewardTerm | Sequence[RewardTerm | tuple[RewardTerm, float]]

_TERM = re.compile(r"\s*(?:(?P<weight>\d+(?:\.\d*)?(?:[eE]-?\d+)?)\s*\*\s*)?(?P<name>[\w.:]+)\s*")
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def exact_match(completion_text: str, answer: str) -> float:
    """1.0 when the completion is nothing but the answer (numerically equal: ``9`` = ``0009``)."""
    whole = WHOLE_NUMBER.fullmatch(completion_text)
    if whole is None:
        return float(completion_text.strip() == answer.strip())
    reference = as_number(answer)
    return float(reference is not None and float(whole.group(1)) == reference)


def math_answer(completion_text: str, answer: str) -> float:
    """1.0 when the answer read out of the text matches; the last number counts, so
    ``"0009 12"`` (the model kept talking) does not score."""
    predicted = extract_answer(completion_text)
    return float(predicted is not None and answers_match(predicted, answer))


def format_reward(completion_text: str, answer: str) -> float:
    """1.0 for a well-formed completion: a bare number or a ``\\boxed{}`` answer."""
    del answer  # the shape alone counts
    return float(format_ok(completion_text))


REWARDS: dict[str, RewardFn] = {"exact": exact_match, "math": math_answer,
                                "format": format_reward}


def _check_callable(fn: Any, label: str) -> RewardFn:
    if not callable(fn):
        raise ValueError(f"reward {label!r} is not callable: {fn!r}")
    try:
        inspect.signature(fn).bind("completion", "answer")
    except TypeError as err:
        raise ValueError(f"reward {label!r} must accept (completion_text, answer): {err}") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def _check_term(term: RewardTerm) -> None:
    """Checks a term without importing anything: a callable's signature, a name's spelling."""
    if callable(term):
        _check_callable(term, getattr(term, "__name__", repr(term)))
    elif ":" in term:
        if not _IMPORT_PATH.fullmatch(term):
            raise ValueError(f"reward {term!r}: write an import path as 'module:function'")
    elif term != "auto" and term not in REWARDS:
        raise ValueError(f"reward {term!r}: unknown; use one of {sorted(REWARDS)}, 'auto', "
                         "'module:function', or a weighted sum such as 'math+0.1*format'")


def _resolve(term: RewardTerm, default: str) -> RewardFn:
    if callable(term):
        return term
    name = default if term == "auto" else term
    if ":" not in name:
        return REWARDS[name]
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward {name!r}: cannot import it ({err})") from None
    return _check_callable(fn, name)


def reward_terms(spec: RewardSpec = "auto") -> tuple[tuple[RewardTerm, float], ...]:
    """``spec`` as ``(term, weight)`` pairs, checked without importing anything (a config's
    validation); ``ValueError`` names the bad term."""
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
        _check_term(term)
        if not math.isfinite(weight):
            raise ValueError(f"reward {term!r}: weight {weight} is not finite")
    return tuple(terms)


@dataclass(frozen=True)
class WeightedReward:
    """``Σ weight × term(completion_text, answer)``; picklable when its terms are names."""

    terms: tuple[tuple[RewardTerm, float], ...]
    default: str = "math"

    def __post_init__(self) -> None:
        for term, _ in self.terms:
            _resolve(term, self.default)  # an import path that fails, fails here

    @property
    def names(self) -> list[str]:
        return [t if isinstance(t, str) else getattr(t, "__name__", repr(t)) for t, _ in self.terms]

    def __call__(self, completion_text: str, answer: str) -> float:
        total = 0.0
        for term, weight in self.terms:
            value = _resolve(term, self.default)(completion_text, answer)
            try:
                total += weight * float(value)
            except (TypeError, ValueError):
                raise TypeError(f"reward {term!r} returned {value!r}, not a number") from None
        return total


def make_reward(spec: RewardSpec = "auto", *, default: str = "math") -> WeightedReward:
    """The reward a spec names (see the module docstring); ``"auto"`` means ``default``."""
    if default == "auto" or default not in REWARDS:
        raise ValueError(f"reward default={default!r}: use one of {sorted(REWARDS)}")
    return WeightedReward(reward_terms(spec), default)
