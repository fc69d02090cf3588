"""Datasets by name: ``load_task`` → train / test rows of ``prompt``, ``messages``, ``answer``
from ``"arithmetic[:Ndigit][:+-]"``, a hub dataset (``"owner/name[:config]"``) or a
``.json``/``.jsonl``/``.parquet`` file or folder of GSM8K, OpenR1-Math or ``messages`` rows.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_nb.config import InputError
from grpo_nb.tasks.arithmetic import (
    ARITHMETIC_NAME,
    ArithmeticTaskConfig,
    arithmetic_config,
    is_arithmetic_name,
    make_dataset,
)
from grpo_nb.tasks.files import FILE_BUILDERS, check_data_file, check_data_folder
from grpo_nb.tasks.rewards import after_hashes, extract_answer, reward_terms

if TYPE_CHECKING:  # imported where data is loaded: checking a config needs no datasets
    import datasets

HUB_INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."
HUB_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}
_HUB_NAME = re.compile(r"[\w.-]+(?:/[\w.-]+)?(?::[\w.-]+)?")
Row = dict[str, Any]
FORMATS = ("GSM8K (question, answer ending '#### N'), OpenR1-Math (problem, answer), "
           "or messages (a chat ending with the assistant's answer)")


@dataclass
class Task:
    """A loaded task: its splits, and the reward ``"auto"`` stands for."""

    kind: str  # "arithmetic" (exact answers, chat-free) or "math" (answers in text)
    train: datasets.Dataset
    test: datasets.Dataset

    @property
    def default_reward(self) -> str:
        return "exact" if self.kind == "arithmetic" else "math"


def dataset_source(dataset: str) -> str:
    """``"arithmetic"``, ``"local"`` or ``"hub"``, without loading anything."""
    if not isinstance(dataset, str) or not dataset.strip():
        raise ValueError(f"dataset={dataset!r}: give 'arithmetic', a hub name or a file/folder")
    if is_arithmetic_name(dataset):
        if ARITHMETIC_NAME.fullmatch(dataset) is None:
            arithmetic_config(dataset)  # raises, naming the accepted forms
        return "arithmetic"
    path = Path(dataset).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() not in FILE_BUILDERS:
            raise ValueError(f"dataset={dataset!r}: use a .json, .jsonl or .parquet file")
        return "local"
    if path.suffix.lower() in FILE_BUILDERS or dataset.startswith((".", "/", "~")):
        raise FileNotFoundError(f"dataset={dataset!r}: no such file or folder")
    if not _HUB_NAME.fullmatch(dataset):
        raise ValueError(f"dataset={dataset!r}: not a hub name ('owner/name[:config]') or a path")
    return "hub"


def _load_local(path: Path) -> datasets.DatasetDict:
    import datasets

    if path.is_file():
        check_data_file(path)  # a malformed file: its line named here, not the loader's row
        builder = FILE_BUILDERS[path.suffix.lower()]
        try:
            return datasets.load_dataset(builder, data_files=str(path))
        except datasets.exceptions.DatasetGenerationError as err:  # e.g. a column's type changes
            raise InputError(f"dataset {path}: the {builder} loader could not read it "
                             f"({_root_cause(err)}); expected {FORMATS}") from None
    if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
        loaded = datasets.load_from_disk(str(path))  # a save_to_disk() folder
        return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(
            train=loaded)
    check_data_folder(path)
    try:
        return datasets.load_dataset(str(path))  # train.jsonl / test.parquet / data/… layouts
    except (FileNotFoundError, ValueError) as err:
        raise InputError(f"dataset {path}: no .json/.jsonl/.parquet data in it ({err})") from None
    except datasets.exceptions.DatasetGenerationError as err:
        raise InputError(f"dataset {path}: the loader could not read its files "
                         f"({_root_cause(err)}); expected {FORMATS}") from None


def _root_cause(err: BaseException) -> str:
    """The first line of the innermost error ``err`` was raised from."""
    while (inner := err.__cause__ or err.__context__) is not None:
        err = inner
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def _load_hub(name: str) -> datasets.DatasetDict:
    import datasets

    repo, _, config = name.partition(":")
    try:
        return datasets.load_dataset(repo, config or HUB_CONFIGS.get(repo))
    except Exception as err:  # offline, gated, misspelt: all need the same advice
        raise RuntimeError(
            f"dataset={name!r}: could not load it from the Hugging Face hub "
            f"({type(err).__name__}: {err}). Offline? Use a cached copy, a local "
            ".json/.jsonl/.parquet file or folder in GSM8K or messages format, or 'arithmetic'."
        ) from err


def _splits(data: datasets.DatasetDict, where: str, test_size: int | float | None,
            split_seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The source's own train/test splits, else a seeded split of ``test_size`` rows (or 10 %)."""
    if not data:
        raise InputError(f"{where}: no data")
    train_name = "train" if "train" in data else next(iter(data))
    test_name = next((s for s in ("test", "validation") if s in data and s != train_name), None)
    train = data[train_name]
    _check_format({name: data[name] for name in (train_name, test_name) if name}, where)
    if test_name is not None:
        return train, data[test_name]
    size = 0.1 if test_size is None else test_size
    count = round(size * len(train)) if isinstance(size, float) else int(size)
    if not 1 <= count < len(train):
        raise InputError(f"test_size={test_size!r}: {where} has {len(train)} rows and no test "
                         "split; hold out at least 1 row and leave at least 1 to train on")
    split = train.train_test_split(test_size=count, seed=split_seed)
    return split["train"], split["test"]


def _question(columns: list[str], where: str) -> str | None:
    """The rows' question field (``None``: ``messages`` rows), in one of :data:`FORMATS`."""
    cols = set(columns)
    if "messages" in cols:
        return None
    question = next((q for q in ("question", "problem") if q in cols), None)
    if question is None:
        raise InputError(f"{where}: unknown row format, columns {sorted(cols)}; "
                         f"expected {FORMATS}")
    if "answer" not in cols:
        raise InputError(f"{where}: the rows have a {question!r} field but no 'answer' field; "
                         f"expected {FORMATS}")
    return question


def _check_format(splits: dict[str, datasets.Dataset], where: str) -> None:
    """Each split's rows in one of :data:`FORMATS`, every row with its fields: checked before a
    test split is held out, so a missing field is named as such (not as too few rows to split)."""
    import pyarrow.compute as pc

    for name, split in splits.items():
        question = _question(split.column_names, f"{where} ({name})")
        for col in [question, "answer"] if question else ["messages"]:
            column = split.data.table.column(col)
            if column.null_count:
                row = pc.index(pc.is_null(column), True).as_py() + 1
                raise InputError(f"{where} ({name}), row {row} (counting from 1): no {col!r} "
                                 "value; every row needs one")


def _with_messages(ds: datasets.Dataset, system_prompt: str | None) -> datasets.Dataset:
    """``ds`` plus a ``messages`` column (system?, user), built in Arrow: ``map`` is slower."""
    import pyarrow as pa

    prompts = ds.data.table.column("prompt").to_pylist()
    return ds.add_column("messages", pa.array(
        [_chat(system_prompt, [{"role": "user", "content": p}]) for p in prompts]))


def _chat(system_prompt: str | None, turns: list[Row]) -> list[Row]:
    """``turns`` with the configured system prompt replacing any system turn they had."""
    if system_prompt is None:
        return turns
    return [{"role": "system", "content": system_prompt},
            *[t for t in turns if t["role"] != "system"]]


def _from_messages(row: Row, where: str, system_prompt: str | None) -> Row:
    turns = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"] or []]
    users = [t["content"] for t in turns[:-1] if t["role"] == "user"]
    if not users or turns[-1]["role"] != "assistant":
        raise InputError(f"{where}: 'messages' must end with the assistant's answer after a "
                         f"user turn; roles are {[t['role'] for t in turns]}")
    answer = row.get("answer")
    answer = (after_hashes(str(answer)) or str(answer).strip()) if answer is not None else (
        extract_answer(turns[-1]["content"], last_number=False))
    if not answer:
        raise InputError(f"{where}: cannot find the final answer in the assistant turn "
                         f"{turns[-1]['content'][-80:]!r}: end it with '#### N' or "
                         "'\\boxed{N}', or add an 'answer' column")
    return {"prompt": users[-1], "messages": _chat(system_prompt, turns[:-1]), "answer": answer}


def _row_converter(columns: list[str], where: str, system_prompt: str | None,
                  instruction: str | None) -> Callable[[Row, int], Row]:
    if (question := _question(columns, where)) is None:
        return lambda row, i: _from_messages(row, f"{where}, row {i}", system_prompt)

    def convert(row: Row, i: int) -> Row:
        text = str(row[question]).strip()
        prompt = f"{text}\n{instruction}" if instruction else text
        answer = str(row["answer"]).strip()  # OpenR1-Math: the answer itself
        if question == "question" and (answer := after_hashes(answer)) is None:
            raise InputError(f"{where}, row {i}: GSM8K answer without '#### <final answer>': "
                             f"{str(row['answer'])[-80:]!r}")
        return {"prompt": prompt, "answer": answer,
                "messages": _chat(system_prompt, [{"role": "user", "content": prompt}])}

    return convert


def load_task(dataset: str, *, test_size: int | float | None = None, split_seed: int = 0,
              system_prompt: str | None = None, instruction: str | None = HUB_INSTRUCTION,
              arithmetic: ArithmeticTaskConfig | None = None) -> Task:
    """A task by name or path; ``test_size`` is held out when it has no test split (for
    arithmetic: ``n_test``), ``system_prompt`` replaces any system turn."""
    if is_arithmetic_name(dataset):
        cfg = arithmetic_config(dataset, arithmetic)
        if test_size is not None:
            if not isinstance(test_size, int):
                raise ValueError(f"test_size={test_size!r}: the arithmetic task needs a row count")
            cfg = dataclasses.replace(cfg, n_test=test_size)
        data = make_dataset(cfg)
        return Task("arithmetic", _with_messages(data["train"], system_prompt),
                    _with_messages(data["test"], system_prompt))
    where = f"dataset {dataset!r}"
    source = dataset_source(dataset)
    data = _load_local(Path(dataset).expanduser()) if source == "local" else _load_hub(dataset)
    train, test = _splits(data, where, test_size, split_seed)
    rows = {}
    for name, raw in (("train", train), ("test", test)):  # as prompt, messages, answer rows
        if len(raw) == 0:
            raise InputError(f"{where} ({name}): no rows")
        convert = _row_converter(raw.column_names, f"{where} ({name})", system_prompt, instruction)
        rows[name] = raw.map(convert, with_indices=True, remove_columns=raw.column_names)
    return Task("math", rows["train"], rows["test"])


def check_task_fields(cfg: Any) -> None:
    """An ``LLMConfig``'s data and reward fields, checked without loading or importing anything,
    after ``check_fields`` has checked their types."""
    try:
        dataset_source(cfg.dataset)
    except (ValueError, FileNotFoundError) as err:
        why = str(err).removeprefix(f"dataset={cfg.dataset!r}: ")
        raise ValueError(f"LLMConfig.dataset={cfg.dataset!r}: {why}") from None
    size = cfg.test_size
    if size is not None and not (size >= 1 if isinstance(size, int) else 0 < size < 1):
        raise ValueError(f"LLMConfig.test_size={size!r}: a row count >= 1, a fraction in "
                         "(0, 1), or None (the data's test split, else 10 %)")
    try:
        reward_terms(cfg.reward)
    except (ValueError, TypeError) as err:
        raise ValueError(f"LLMConfig.reward={cfg.reward!r}: {err}") from None
