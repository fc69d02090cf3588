"""Datasets by configuration: one name or path in, train / test rows out.

    load_task("arithmetic" | "arithmetic:2digit:+-"      the offline family (no files at all)
              "openai/gsm8k" | "owner/name:config"        the hub (needs internet or its cache)
              "data.jsonl" | "data.parquet" | "folder/"   GSM8K rows or chat ``messages`` rows
    ) ─► Task(train, test): prompt, messages, answer

Row formats: GSM8K (``question``, ``answer`` ending ``#### 72``), OpenR1-Math (``problem``,
``answer``), or ``messages`` (a chat whose last turn is the assistant's answer, ending
``#### 72`` or ``\\boxed{72}``; an ``answer`` column, when present, wins). Each output row has
``prompt`` (the user's text), ``messages`` (the chat up to the answer, with the configured
system prompt) and ``answer`` (the bare reference answer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from grpo_nb.tasks.arithmetic import (
    ARITHMETIC_NAME,
    ArithmeticTaskConfig,
    arithmetic_config,
    is_arithmetic_name,
    make_dataset,
)
from grpo_nb.tasks.prompts import prompt_text
from grpo_nb.tasks.rewards import RewardSpec, WeightedReward, make_reward
from grpo_nb.tasks.rows import to_task_rows

HUB_INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
HUB_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}
_HUB_NAME = re.compile(r"[\w.-]+(?:/[\w.-]+)?(?::[\w.-]+)?")


@dataclass
class Task:
    """A loaded task: its splits, and what rewards and prompts default to for it."""

    name: str
    kind: str  # "arithmetic" (exact answers, chat-free) or "math" (answers in text)
    train: datasets.Dataset
    test: datasets.Dataset
    system_prompt: str | None = None

    @property
    def default_reward(self) -> str:
        return "exact" if self.kind == "arithmetic" else "math"

    def reward(self, spec: RewardSpec = "auto", weights: list[float] | None = None
               ) -> WeightedReward:
        """:func:`make_reward` with ``"auto"`` meaning this task's default."""
        return make_reward(spec, weights, default=self.default_reward)

    def prompt_example(self, tokenizer: Any, **template_kwargs: Any) -> str:
        """The first training prompt as the model sees it (chat template applied)."""
        return prompt_text(tokenizer, self.train[0], chat_template_kwargs=template_kwargs)


def dataset_source(dataset: str) -> str:
    """``"arithmetic"``, ``"local"`` or ``"hub"`` — cheap, for validating a config field.

    Raises ``ValueError`` for a malformed name, ``FileNotFoundError`` for a missing path.
    """
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
    if path.is_file():
        if path.stat().st_size == 0:
            raise ValueError(f"dataset {path}: the file is empty")
        builder = FILE_BUILDERS[path.suffix.lower()]
        return datasets.load_dataset(builder, data_files=str(path))
    if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
        loaded = datasets.load_from_disk(str(path))  # a save_to_disk() folder
        return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(
            train=loaded)
    try:
        return datasets.load_dataset(str(path))  # train.jsonl / test.parquet / data/… layouts
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"dataset {path}: no .json/.jsonl/.parquet data in it ({err})") from None


def _load_hub(name: str) -> datasets.DatasetDict:
    repo, _, config = name.partition(":")
    try:
        return datasets.load_dataset(repo, config or HUB_CONFIGS.get(repo))
    except Exception as err:  # offline, gated, misspelt: all need the same advice
        raise RuntimeError(
            f"dataset={name!r}: could not load it from the Hugging Face hub "
            f"({type(err).__name__}: {err}). Offline? Use a cached copy, a local "
            ".json/.jsonl/.parquet file or folder in GSM8K or messages format, or 'arithmetic'."
        ) from err


def _load_source(dataset: str) -> datasets.DatasetDict:
    kind = dataset_source(dataset)
    if kind == "local":
        return _load_local(Path(dataset).expanduser())
    return _load_hub(dataset)


def _held_out(test_size: int | float | None, n: int, where: str) -> int:
    """How many of ``n`` rows to hold out (``test_size``: a count, a fraction, or 10 %)."""
    size = 0.1 if test_size is None else test_size
    count = round(size * n) if isinstance(size, float) else int(size)
    if not 1 <= count < n:
        raise ValueError(f"test_size={test_size!r}: {where} has {n} rows and no test split; "
                         "hold out at least 1 row and leave at least 1 to train on")
    return count


def _splits(data: datasets.DatasetDict, where: str, test_size: int | float | None,
            split_seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The source's own train/test splits when it has them, else a seeded held-out split."""
    if not data:
        raise ValueError(f"{where}: no data")
    train_name = "train" if "train" in data else next(iter(data))
    test_name = next((s for s in ("test", "validation") if s in data and s != train_name), None)
    train = data[train_name]
    if test_name is not None:
        return train, data[test_name]
    if len(train) == 0:
        raise ValueError(f"{where}: no rows")
    split = train.train_test_split(test_size=_held_out(test_size, len(train), where),
                                   seed=split_seed)
    return split["train"], split["test"]


def _with_messages(ds: datasets.Dataset, system_prompt: str | None) -> datasets.Dataset:
    """``ds`` plus a ``messages`` column (system?, user = prompt), built in Arrow.

    ``Dataset.add_column`` with Python dicts takes seconds for 20,000 rows; the tiny model's
    ring should not wait for a column it does not even use.
    """
    import pyarrow as pa

    prompts = ds.data.table.column("prompt").to_pylist()
    turns = 1 if system_prompt is None else 2
    roles = (["user"] if system_prompt is None else ["system", "user"]) * len(prompts)
    contents = prompts if system_prompt is None else [
        text for p in prompts for text in (system_prompt, p)]
    turn_array = pa.StructArray.from_arrays([pa.array(roles, pa.string()),
                                             pa.array(contents, pa.string())],
                                            names=["role", "content"])
    offsets = pa.array(range(0, turns * len(prompts) + 1, turns), pa.int32())
    table = ds.data.table.append_column("messages", pa.ListArray.from_arrays(offsets, turn_array))
    return datasets.Dataset(datasets.table.InMemoryTable(table))


def _arithmetic_task(name: str, base: ArithmeticTaskConfig | None,
                     test_size: int | float | None, system_prompt: str | None) -> Task:
    cfg = arithmetic_config(name, base)
    if test_size is not None:
        if not isinstance(test_size, int):
            raise ValueError(f"test_size={test_size!r}: the arithmetic task needs a row count")
        cfg = ArithmeticTaskConfig(cfg.digits, cfg.ops, cfg.n_train, test_size, cfg.seed)
    data = make_dataset(cfg)

    def chat(ds: datasets.Dataset) -> datasets.Dataset:
        return _with_messages(ds, system_prompt)

    return Task(name, "arithmetic", chat(data["train"]), chat(data["test"]), system_prompt)


def load_task(dataset: str, *, test_size: int | float | None = None, split_seed: int = 0,
              system_prompt: str | None = None, instruction: str | None = HUB_INSTRUCTION,
              arithmetic: ArithmeticTaskConfig | None = None) -> Task:
    """Load a task by name or path (see the module docstring) as train / test rows.

    Args:
        test_size: rows (int) or fraction (float) held out when the source has no test or
            validation split (default 10 %); for the arithmetic family, its ``n_test``.
        split_seed: seeds that held-out split (the same seed gives the same split).
        system_prompt: a system turn put first in every row's ``messages`` (replacing any).
        instruction: appended to GSM8K / OpenR1 questions (``None``: the question alone).
        arithmetic: the base config for the arithmetic family (the name's suffix overrides it).

    Raises ``ValueError`` / ``FileNotFoundError`` naming the problem, ``RuntimeError`` when a
    hub dataset cannot be fetched.
    """
    if is_arithmetic_name(dataset):
        return _arithmetic_task(dataset, arithmetic, test_size, system_prompt)
    where = f"dataset {dataset!r}"
    train, test = _splits(_load_source(dataset), where, test_size, split_seed)
    rows = {name: to_task_rows(split, f"{where} ({name})", system_prompt=system_prompt,
                               instruction=instruction)
            for name, split in (("train", train), ("test", test))}
    return Task(dataset, "math", rows["train"], rows["test"], system_prompt)


def load_hub_math(name_or_path: str, split: str = "train") -> datasets.Dataset:
    """One split of a math dataset (hub name, folder or file) as ``prompt, messages, answer``.

    A file has one split, returned whatever ``split`` says. Prefer :func:`load_task`.
    """
    data = _load_source(name_or_path)
    if split not in data:
        if len(data) != 1:
            raise ValueError(f"dataset {name_or_path!r}: no split {split!r} in {list(data)}")
        split = next(iter(data))
    return to_task_rows(data[split], f"dataset {name_or_path!r}", system_prompt=None,
                        instruction=HUB_INSTRUCTION)
