"""Prompts with verifiable answers: offline arithmetic, or a hub math dataset when online.

GRPO needs a *verifier*, not labels: a function that says how good a completion is. This module
gives every task the same three pieces — a dataset of ``prompt`` / ``answer`` rows, an answer
extractor and a reward — so that the rollout code never knows which task it serves::

    ArithmeticTaskConfig ──make_dataset()──► DatasetDict{train, test}: prompt, answer, ...
    GSM8K / OpenR1-Math  ──load_hub_math()─► Dataset: prompt, answer, messages
                                                   │
                     completion text ─► extract_answer() ─► reward(text, answer) ─► float

Prompt format. The offline task's prompt is the bare problem, ``"003+006="``, and the answer is
the zero-padded sum, ``"0009"``, followed by the end-of-sequence token. A chat template around
it would cost a character-level model dozens of tokens per prompt for no information, so the
offline task is deliberately *chat-free*. Hub rows also carry ``messages`` (one user turn), and
:func:`render_prompt` applies the tokenizer's chat template when it has one (Qwen3 does): the
same rollout code serves both.

Reward. ``1.0`` when the extracted answer equals the reference numerically (exact integers
for the arithmetic task; math-verify for LaTeX answers such as ``\\frac{1}{2}``), plus
``format_weight`` when the completion has the expected shape (for the arithmetic task: nothing
but a number; for hub answers: a ``\\boxed{}`` answer).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

_OPS = ("+", "-")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WHOLE_NUMBER = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*")
HUB_INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."


@dataclass
class ArithmeticTaskConfig:
    """Sums (and optionally differences) of two zero-padded ``digits``-digit numbers.

    Args:
        digits: digits per operand (3 → ``"042+917="``); the answer has ``digits + 1``
            characters, zero-padded (``"0959"``), with a leading ``-`` for negative differences.
        ops: which operations to sample from, a subset of ``("+", "-")``.
        n_train / n_test: distinct problems per split (the splits never share a problem).
        seed: makes the dataset reproducible.
    """

    digits: int = 3
    ops: tuple[str, ...] = ("+",)
    n_train: int = 20_000
    n_test: int = 1_000
    seed: int = 0

    def __post_init__(self) -> None:
        self.ops = tuple(self.ops)
        if not 1 <= self.digits <= 9:
            raise ValueError(f"ArithmeticTaskConfig.digits={self.digits}: use 1..9")
        if not self.ops or any(op not in _OPS for op in self.ops):
            raise ValueError(f"ArithmeticTaskConfig.ops={self.ops}: use a subset of {_OPS}")
        if self.n_train < 1 or self.n_test < 1:
            raise ValueError(
                f"ArithmeticTaskConfig.n_train={self.n_train}, n_test={self.n_test}: need ≥ 1 each"
            )
        space = len(self.ops) * (10**self.digits) ** 2
        if self.n_train + self.n_test > space // 2:
            raise ValueError(
                f"ArithmeticTaskConfig.n_train + n_test = {self.n_train + self.n_test} is more "
                f"than half of the {space} distinct problems with digits={self.digits}"
            )

    @classmethod
    def smoke(cls) -> ArithmeticTaskConfig:
        """Small enough for CI; still 3-digit sums so the tiny model's skill carries over."""
        return cls(n_train=20_000, n_test=500)


def format_problem(a: int, b: int, op: str, digits: int) -> tuple[str, str]:
    """``(prompt, answer)`` for one problem: ``(3, 6, "+", 3)`` → ``("003+006=", "0009")``."""
    value = a + b if op == "+" else a - b
    sign = "-" if value < 0 else ""
    return f"{a:0{digits}d}{op}{b:0{digits}d}=", f"{sign}{abs(value):0{digits + 1}d}"


def make_dataset(cfg: ArithmeticTaskConfig | None = None) -> datasets.DatasetDict:
    """Generate the train / test splits: columns ``prompt``, ``answer``, ``a``, ``b``, ``op``."""
    cfg = cfg or ArithmeticTaskConfig()
    rng = random.Random(cfg.seed)
    seen: set[tuple[int, int, str]] = set()
    rows: list[dict[str, Any]] = []
    high = 10**cfg.digits - 1
    while len(rows) < cfg.n_train + cfg.n_test:
        key = (rng.randint(0, high), rng.randint(0, high), rng.choice(cfg.ops))
        if key in seen:
            continue
        seen.add(key)
        prompt, answer = format_problem(*key, digits=cfg.digits)
        rows.append({"prompt": prompt, "answer": answer, "a": key[0], "b": key[1], "op": key[2]})
    train, test = rows[: cfg.n_train], rows[cfg.n_train :]
    return datasets.DatasetDict(
        train=datasets.Dataset.from_list(train), test=datasets.Dataset.from_list(test)
    )


def _last_boxed(text: str) -> str | None:
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


def extract_answer(text: str) -> str | None:
    """The answer a completion gives, or ``None`` when it gives none.

    In order: the whole text when it is just a number (the arithmetic task), the last
    ``\\boxed{}`` (math models), what follows GSM8K's ``####``, else the last number in the text.
    """
    if (whole := _WHOLE_NUMBER.fullmatch(text)) is not None:
        return whole.group(1)
    if (boxed := _last_boxed(text)) is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "") or None
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def answers_match(predicted: str, reference: str) -> bool:
    """Numeric equality when both sides are numbers, else math-verify's symbolic check."""
    p, r = _as_number(predicted), _as_number(reference)
    if p is not None and r is not None:
        return p == r
    from math_verify import parse, verify  # lazy: only LaTeX answers need it

    # math-verify wants the gold answer in math delimiters to parse LaTeX.
    gold = parse(f"${reference}$")
    guess = parse(f"${predicted}$")
    return bool(gold) and bool(guess) and bool(verify(gold, guess))


def format_ok(text: str) -> bool:
    """Whether a completion has the expected shape: a bare number, or a ``\\boxed{}`` answer."""
    return _WHOLE_NUMBER.fullmatch(text) is not None or _last_boxed(text) is not None


def reward(completion_text: str, answer: str, *, format_weight: float = 0.0) -> float:
    """``1.0`` for a correct answer, plus ``format_weight`` for a well-formed completion.

    The arithmetic task is strict by construction: its completions are decoded without the
    end-of-sequence token, so ``"0009"`` scores but ``"0009 12"`` (the model kept talking)
    extracts ``12`` and does not.
    """
    predicted = extract_answer(completion_text)
    correct = predicted is not None and answers_match(predicted, answer)
    return float(correct) + (format_weight if format_ok(completion_text) else 0.0)


# ---------------------------------------------------------------- hub datasets (online users)

@dataclass
class HubMathSpec:
    """Where a hub math dataset keeps its question and answer (the two shapes we support)."""

    question: str
    answer: str
    config: str | None = None
    gsm8k_answer: bool = False  # the answer column ends with "#### 72"
    extra: dict[str, str] = field(default_factory=dict)


HUB_SHAPES: dict[str, HubMathSpec] = {
    "gsm8k": HubMathSpec(question="question", answer="answer", config="main", gsm8k_answer=True),
    "openr1": HubMathSpec(question="problem", answer="answer", config="default"),
}


def _detect_shape(columns: list[str]) -> HubMathSpec:
    if {"question", "answer"} <= set(columns):
        return HUB_SHAPES["gsm8k"]
    if {"problem", "answer"} <= set(columns):
        return HUB_SHAPES["openr1"]
    raise ValueError(
        f"unknown math dataset shape, columns {columns}: expected question/answer (GSM8K) "
        "or problem/answer (OpenR1-Math)"
    )


def _load_raw(name_or_path: str, split: str) -> datasets.Dataset:
    path = Path(name_or_path).expanduser()
    suffix = path.suffix.lower()
    if path.is_file():
        builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(suffix)
        if builder is None:
            raise ValueError(f"{path}: use a .json, .jsonl or .parquet file")
        return datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
    if path.is_dir():
        return datasets.load_dataset(str(path), split=split)
    key = "gsm8k" if "gsm8k" in name_or_path.lower() else "openr1"
    return datasets.load_dataset(name_or_path, HUB_SHAPES[key].config, split=split)


def load_hub_math(name_or_path: str, split: str = "train") -> datasets.Dataset:
    """Load GSM8K / OpenR1-Math (hub name, local folder, or a JSON/Parquet file) as task rows.

    Returns columns ``prompt`` (question + an instruction to box the answer), ``answer`` (the
    bare final answer: GSM8K's text after ``####``), and ``messages`` (one user turn, for a
    chat template). Hub names need internet; files and folders work offline.
    """
    raw = _load_raw(name_or_path, split)
    spec = _detect_shape(list(raw.column_names))

    def to_row(row: dict[str, Any]) -> dict[str, Any]:
        answer = str(row[spec.answer])
        if spec.gsm8k_answer:
            if "####" not in answer:
                raise ValueError(f"GSM8K answer without '####': {answer[:80]!r}")
            answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
        prompt = f"{str(row[spec.question]).strip()}\n{HUB_INSTRUCTION}"
        return {
            "prompt": prompt,
            "answer": answer,
            "messages": [{"role": "user", "content": prompt}],
        }

    return raw.map(to_row, remove_columns=list(raw.column_names))


def render_prompt(tokenizer: Any, row: dict[str, Any]) -> list[int]:
    """Token ids of a row's prompt: through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None) and row.get("messages"):
        ids = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, add_generation_prompt=True
        )
        # transformers 5 returns a BatchEncoding here, 4.x a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer.encode(row["prompt"], add_special_tokens=False))
