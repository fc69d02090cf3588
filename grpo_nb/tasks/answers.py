"""Reading the answer out of a completion, and comparing it with the reference.

Numbers compare numerically (``"9" == "0009"``, ``"1,200" == "1200"``); anything else (LaTeX
such as ``\\frac{1}{2}``) goes through math-verify's symbolic check.
"""

from __future__ import annotations

import re
import threading

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


def answers_match(predicted: str, reference: str) -> bool:
    """Numeric equality when both sides are numbers, else math-verify's symbolic check."""
    p, r = as_number(predicted), as_number(reference)
    if p is not None and r is not None:
        return p == r
    from math_verify import parse, verify  # lazy: only LaTeX answers need it

    # math-verify times out with SIGALRM, which only the main thread may set: an actor scoring
    # in a worker thread would crash on it, so there it runs without a timeout.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    # math-verify wants the gold answer in math delimiters to parse LaTeX.
    gold = parse(f"${reference}$", parsing_timeout=limit)
    guess = parse(f"${predicted}$", parsing_timeout=limit)
    return bool(gold) and bool(guess) and bool(verify(gold, guess, timeout_seconds=limit))


def format_ok(text: str) -> bool:
    """Whether a completion has the expected shape: a bare number, or a ``\\boxed{}`` answer."""
    return WHOLE_NUMBER.fullmatch(text) is not None or last_boxed(text) is not None
