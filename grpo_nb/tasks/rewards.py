"""Rewards chosen by configuration: one registry of ``reward(completion_text, answer) -> float``.

    make_reward("auto" | "math+0.1*format" | "mypkg.rewards:mine" | fn | [..], weights)
        └─► WeightedReward: Σ weight × term(completion_text, answer)

Built-in names: ``exact`` (the arithmetic task: the completion is just the number, equal to the
answer), ``math`` (the answer read out of math text — ``\\boxed{}``, ``####`` or the last
number — checked numerically or with math-verify), ``format`` (1.0 for a bare number or a
``\\boxed{}`` answer). ``"auto"`` stands for the task's own default (``exact`` for arithmetic,
``math`` otherwise). A ``"module:function"`` string imports a user function; unlike a function
passed directly, it survives being sent to an actor in another process by name alone.
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
_NAME = re.compile(r"[A-Za-z_][\w]*")


def exact_match(completion_text: str, answer: str) -> float:
    """1.0 when the completion is nothing but the answer (numerically equal: ``9`` = ``0009``)."""
    whole = WHOLE_NUMBER.fullmatch(completion_text)
    if whole is None:
        return float(completion_text.strip() == answer.strip())
    reference = as_number(answer)
    return float(reference is not None and float(whole.group(1)) == reference)


def math_answer(completion_text: str, answer: str) -> float:
    """1.0 when the answer read out of the text matches (numbers, else math-verify).

    Lenient about the answer's position (the last number counts), so ``"0009"`` scores but
    ``"0009 12"`` (the model kept talking) reads ``12`` and does not.
    """
    predicted = extract_answer(completion_text)
    return float(predicted is not None and answers_match(predicted, answer))


def format_reward(completion_text: str, answer: str) -> float:
    """1.0 for a well-formed completion: a bare number or a ``\\boxed{}`` answer."""
    del answer  # the shape alone counts
    return float(format_ok(completion_text))


REWARDS: dict[str, RewardFn] = {"exact": exact_match, "math": math_answer,
                                "format": format_reward}


def register_reward(name: str, fn: RewardFn) -> None:
    """Add ``fn`` to the registry under ``name`` (this process only: see the module docstring)."""
    if not _NAME.fullmatch(name) or name == "auto":
        raise ValueError(f"reward name {name!r}: use a Python identifier other than 'auto'")
    REWARDS[name] = _check_callable(fn, name)


def _check_callable(fn: Any, label: str) -> RewardFn:
    if not callable(fn):
        raise ValueError(f"reward {label!r} is not callable: {fn!r}")
    try:
        inspect.signature(fn).bind("completion", "answer")
    except TypeError as err:
        raise ValueError(
            f"reward {label!r} must accept (completion_text, answer): {err}"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def _resolve(term: RewardTerm, default: str) -> RewardFn:
    if callable(term):
        return _check_callable(term, getattr(term, "__name__", repr(term)))
    name = default if term == "auto" else term
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward {name!r}: cannot import it ({err})") from None
        return _check_callable(fn, name)
    if name not in REWARDS:
        raise ValueError(
            f"reward {name!r}: unknown; use one of {sorted(REWARDS)}, 'auto', "
            "'module:function', or a weighted sum such as 'math+0.1*format'"
        )
    return REWARDS[name]


def parse_reward(spec: str) -> list[tuple[str, float]]:
    """``"math+0.1*format"`` → ``[("math", 1.0), ("format", 0.1)]`` (names not yet checked)."""
    terms = []
    for part in spec.split("+"):
        match = _TERM.fullmatch(part)
        if match is None:
            raise ValueError(
                f"reward {spec!r}: cannot read the term {part!r}; write e.g. 'math+0.1*format'"
            )
        terms.append((match["name"], float(match["weight"] or 1.0)))
    return terms


@dataclass(frozen=True)
class WeightedReward:
    """``Σ weight × term(completion_text, answer)``; picklable when its terms are names."""

    terms: tuple[tuple[RewardTerm, float], ...]
    default: str = "math"

    def __post_init__(self) -> None:
        if not self.terms:
            raise ValueError("reward: give at least one reward term")
        for term, weight in self.terms:
            if not math.isfinite(weight):
                raise ValueError(f"reward {term!r}: weight {weight} is not finite")
            _resolve(term, self.default)  # fail at configuration time, not mid-run

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


def make_reward(spec: RewardSpec = "auto", weights: Sequence[float] | None = None, *,
                default: str = "math") -> WeightedReward:
    """The reward a configuration names (see the module docstring); ``"auto"`` → ``default``.

    ``spec`` is a name, a ``"a+0.5*b"`` sum, a ``"module:function"``, a callable, or a list of
    those (or of ``(term, weight)`` pairs); ``weights`` (TRL's ``reward_weights``) goes with a
    list, one weight per term. Raises ``ValueError`` naming the bad term.
    """
    if default == "auto" or default not in REWARDS:
        raise ValueError(f"reward default={default!r}: use one of {sorted(REWARDS)}")
    if isinstance(spec, str):
        terms: list[tuple[RewardTerm, float]] = list(parse_reward(spec))
    elif callable(spec):
        terms = [(spec, 1.0)]
    else:
        terms = [t if isinstance(t, tuple) else (t, 1.0) for t in spec]
    if weights is not None:
        if len(weights) != len(terms):
            raise ValueError(f"reward weights={list(weights)}: need one per term ({len(terms)})")
        terms = [(term, float(w)) for (term, _), w in zip(terms, weights, strict=True)]
    return WeightedReward(tuple(terms), default)
