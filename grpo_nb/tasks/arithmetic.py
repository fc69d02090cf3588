"""The offline task: sums (and differences) of zero-padded numbers, ``"003+006="`` → ``"0009"``."""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from annotated_types import MinLen

from grpo_nb.config import Ge, Le, PosInt, check_fields

if TYPE_CHECKING:
    import datasets

ARITHMETIC_NAME = re.compile(r"arithmetic(?::(?P<digits>\d+)digits?)?(?::(?P<ops>[+-]+))?")


@dataclass
class ArithmeticTaskConfig:
    """Two zero-padded ``digits``-digit operands, ``ops`` from ``("+", "-")``, distinct problems."""

    digits: Annotated[int, Ge(1), Le(9)] = 3  # per operand, zero-padded
    ops: Annotated[tuple[Literal["+", "-"], ...], MinLen(1)] = ("+",)  # drawn uniformly
    n_train: PosInt = 20_000  # distinct training problems
    n_test: PosInt = 1_000  # distinct test problems, none in the training split
    seed: int = 0  # the problems' draw

    def __post_init__(self) -> None:
        self.ops = tuple(self.ops)
        check_fields(self)
        space = len(self.ops) * (10**self.digits) ** 2
        if self.n_train + self.n_test > space // 2:
            raise ValueError(f"ArithmeticTaskConfig.n_train + n_test = "
                             f"{self.n_train + self.n_test} is more than half of the {space} "
                             f"distinct problems with digits={self.digits}")

    @classmethod
    def smoke(cls) -> ArithmeticTaskConfig:
        """Small enough for CI; still 3-digit sums so the tiny model's skill carries over."""
        return cls(n_train=20_000, n_test=500)


def is_arithmetic_name(name: str) -> bool:
    return name == "arithmetic" or name.startswith("arithmetic:")


def arithmetic_config(name: str, base: ArithmeticTaskConfig | None = None) -> ArithmeticTaskConfig:
    """The config a dataset name asks for: ``"arithmetic[:Ndigit][:+-]"`` on top of ``base``."""
    match = ARITHMETIC_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"dataset={name!r}: the offline family is 'arithmetic', "
                         "'arithmetic:<N>digit' or 'arithmetic:<N>digit:+-' (N = digits per "
                         "operand, then the operations)")
    changes: dict[str, Any] = {}
    if match["digits"]:
        changes["digits"] = int(match["digits"])
    if match["ops"]:
        changes["ops"] = tuple(dict.fromkeys(match["ops"]))
    return dataclasses.replace(base or ArithmeticTaskConfig(), **changes)


def format_problem(a: int, b: int, op: str, digits: int) -> tuple[str, str]:
    """``(prompt, answer)`` for one problem: ``(3, 6, "+", 3)`` → ``("003+006=", "0009")``."""
    value = a + b if op == "+" else a - b
    sign = "-" if value < 0 else ""
    return f"{a:0{digits}d}{op}{b:0{digits}d}=", f"{sign}{abs(value):0{digits + 1}d}"


def make_dataset(cfg: ArithmeticTaskConfig | None = None) -> datasets.DatasetDict:
    """Generate the train / test splits: columns ``prompt``, ``answer``, ``a``, ``b``, ``op``."""
    import datasets  # here, not at import: the configs and the probe run without it

    cfg = cfg or ArithmeticTaskConfig()
    rng = random.Random(cfg.seed)
    problems: dict[tuple[int, int, str], None] = {}  # distinct, in the order drawn
    high = 10**cfg.digits - 1
    while len(problems) < cfg.n_train + cfg.n_test:
        problems[(rng.randint(0, high), rng.randint(0, high), rng.choice(cfg.ops))] = None
    rows = [dict(zip(("prompt", "answer"), format_problem(a, b, op, cfg.digits), strict=True),
                 a=a, b=b, op=op) for a, b, op in problems]
    return datasets.DatasetDict(train=datasets.Dataset.from_list(rows[: cfg.n_train]),
                                test=datasets.Dataset.from_list(rows[cfg.n_train :]))
