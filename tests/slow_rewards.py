"""Rewards that misbehave, for ``test_scoring.py``; a module of their own, so that the scoring
child process imports them by name (``"slow_rewards:by_text"``) without the test's imports."""

from __future__ import annotations

import time


def by_text(completion_text: str, answer: str) -> float:
    """``"sleep:S"`` sleeps S seconds, then scores 1; ``"hang"`` sleeps 30 s; ``"boom"``
    raises; any other text scores 1 when it is the answer."""
    if completion_text.startswith("sleep:"):
        time.sleep(float(completion_text.removeprefix("sleep:")))
        return 1.0
    if completion_text == "hang":
        time.sleep(30.0)
    if completion_text == "boom":
        raise ValueError("boom: this reward fails")
    return float(completion_text == answer)


def alarm_fires(completion_text: str, answer: str) -> float:
    """1 when math-verify's own (SIGALRM) timeout interrupts a 5 s sleep after 1 s."""
    del completion_text, answer
    from math_verify.errors import TimeoutException
    from math_verify.utils import timeout

    try:
        timeout(1)(time.sleep)(5)
    except TimeoutException:
        return 1.0
    return 0.0
