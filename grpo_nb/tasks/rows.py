"""Row formats → ``prompt, messages, answer``: GSM8K (``question``, ``answer`` ending ``#### 72``),
OpenR1-Math (``problem``, ``answer``), or ``messages`` (a chat ending with the assistant's answer,
``#### 72`` or ``\\boxed{72}``; an ``answer`` column, when present, wins)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets

from grpo_nb.tasks.answers import after_hashes, extract_answer

FORMATS = ("GSM8K (question, answer ending '#### N'), OpenR1-Math (problem, answer), "
           "or messages (a chat ending with the assistant's answer)")

Row = dict[str, Any]


def _chat(system_prompt: str | None, turns: list[Row]) -> list[Row]:
    """``turns`` with the configured system prompt replacing any system turn they had."""
    if system_prompt is None:
        return turns
    return [{"role": "system", "content": system_prompt},
            *[t for t in turns if t["role"] != "system"]]


def _gsm8k(row: Row, where: str) -> str:
    answer = after_hashes(str(row["answer"]))
    if answer is None:
        raise ValueError(f"{where}: GSM8K answer without '#### <final answer>': "
                         f"{str(row['answer'])[-80:]!r}")
    return answer


def _from_messages(row: Row, where: str, system_prompt: str | None) -> Row:
    turns = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"] or []]
    if len(turns) < 2 or turns[-1]["role"] != "assistant":
        raise ValueError(f"{where}: 'messages' must end with the assistant's answer after a "
                         f"user turn; roles are {[t['role'] for t in turns]}")
    users = [t["content"] for t in turns[:-1] if t["role"] == "user"]
    if not users:
        raise ValueError(f"{where}: 'messages' has no user turn before the answer")
    answer = row.get("answer")
    answer = (after_hashes(str(answer)) or str(answer).strip()) if answer is not None else (
        extract_answer(turns[-1]["content"], last_number=False))
    if not answer:
        raise ValueError(f"{where}: cannot find the final answer in the assistant turn "
                         f"{turns[-1]['content'][-80:]!r}: end it with '#### N' or "
                         "'\\boxed{N}', or add an 'answer' column")
    return {"prompt": users[-1], "messages": _chat(system_prompt, turns[:-1]), "answer": answer}


def row_converter(columns: list[str], where: str, system_prompt: str | None,
                  instruction: str | None) -> Callable[[Row, int], Row]:
    cols = set(columns)
    if "messages" in cols:
        return lambda row, i: _from_messages(row, f"{where}, row {i}", system_prompt)
    if {"question", "answer"} <= cols:
        question, answer_of = "question", _gsm8k
    elif {"problem", "answer"} <= cols:
        question, answer_of = "problem", lambda row, where: str(row["answer"]).strip()
    else:
        raise ValueError(f"{where}: unknown row format, columns {sorted(cols)}; expected {FORMATS}")

    def convert(row: Row, i: int) -> Row:
        text = str(row[question]).strip()
        prompt = f"{text}\n{instruction}" if instruction else text
        return {"prompt": prompt, "answer": answer_of(row, f"{where}, row {i}"),
                "messages": _chat(system_prompt, [{"role": "user", "content": prompt}])}

    return convert


def to_task_rows(raw: datasets.Dataset, where: str, *, system_prompt: str | None,
                 instruction: str | None) -> datasets.Dataset:
    """``raw`` as ``prompt, messages, answer`` rows; ``ValueError`` naming the bad row."""
    if len(raw) == 0:
        raise ValueError(f"{where}: no rows")
    convert = row_converter(list(raw.column_names), where, system_prompt, instruction)
    return raw.map(convert, with_indices=True, remove_columns=list(raw.column_names))
