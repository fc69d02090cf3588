"""The ring core both trainers keep (:class:`Ledger`): the credits, each group's staleness and
its admission, and DAPO's dynamic sampling (:class:`DynamicSampling`). Plain arithmetic, no
actors: notebook 05's Exercise 2 has the learner write :func:`admit` and :func:`issued`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from grpo_nb.grpo import zero_std_groups

Admit = Callable[[int, int, int], bool]
"""``admit(step, group_version, max_staleness) -> bool``: train on a group sampled with weights
``group_version`` when the trainer has taken ``step`` steps (its newest weights: version ``step``)?"""

DYNAMIC_DROP_CAP = 3  # dynamic sampling drops at most this many times a step's groups a step


def staleness(step: int, version: int) -> int:
    """How many versions the weights that sampled a group (in the LLM ring: its oldest token,
    ``Group.policy_version``) are behind the trainer's after ``step`` steps."""
    return step - version


def admit(step: int, group_version: int, max_staleness: int) -> bool:
    """The rings' admission rule: a group at most ``max_staleness`` versions stale is trained on;
    a completion a sync split between two versions counts by its older part."""
    return staleness(step, group_version) <= max_staleness


RULE: Admit = admit  # the rule a Ledger applies unless it is given another


def issued(received: int, mode: str, max_ahead: int, per_step: int) -> int:
    """The credits: how many groups the generators may have started in all once the trainer has
    received ``received`` (dropped ones included): each of those, plus ``1 + max_ahead`` steps'
    worth in ``"async"`` mode (sampling while it trains), one step's worth in ``"sync"``."""
    return received + (1 + (max_ahead if mode == "async" else 0)) * per_step


@dataclass
class DynamicSampling:
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero advantages, so no
    gradient; :meth:`drops` says to drop it, and the trainer then credits a replacement, so the
    step trains on ``per_step`` groups that carry gradient. At most ``DYNAMIC_DROP_CAP ×
    per_step`` groups are dropped a step: past that (a task solved or hopeless for the policy,
    where every group is flat) the step takes the groups that come, equal-reward ones included,
    and :meth:`row` says ``dynamic_capped``."""

    per_step: int  # the groups a step trains on
    total: int = 0  # equal-reward groups dropped over the run
    dropped: int = 0  # ... while collecting the current step
    capped: bool = False  # the current step reached the cap

    def new_step(self) -> None:
        self.dropped, self.capped = 0, False

    def drops(self, rewards: Any) -> bool:
        """Drop this group (its ``rewards`` all equal, the cap not reached)? Counts the drop."""
        if zero_std_groups(torch.as_tensor(rewards, dtype=torch.float32), len(rewards)) == 0:
            return False
        if self.dropped >= DYNAMIC_DROP_CAP * self.per_step:
            self.capped = True
            return False
        self.dropped += 1
        self.total += 1
        return True

    def row(self) -> dict[str, Any]:
        """The step row's fields: dropped this step, over the run, and whether the cap was hit."""
        return {"dynamic_dropped": self.dropped, "dynamic_dropped_total": self.total,
                "dynamic_capped": self.capped}


class Ledger:
    """A trainer's account of its ring: the credits it issued and the groups it received
    (:attr:`outstanding` the difference), told to the generators as ``progress(version,
    issued)``; each arriving group's fate (:meth:`take`): dropped as too stale by ``admit``
    (reported as a ``dropped`` row), dropped as flat by dynamic sampling, or trained on; every
    drop is replaced by one more credit at once, so the step still fills."""

    def __init__(self, mode: str, max_ahead: int, per_step: int, *,
                 max_staleness: int | None = None, dynamic_sampling: bool = False,
                 admit: Admit | None = None, report: Callable[..., None] | None = None) -> None:
        """``max_staleness`` None admits every group (the toy ring has no bound); ``admit``
        replaces the rule (:func:`admit`, called as ``admit(step, version, max_staleness)``);
        ``report(kind, **row)`` receives the ``dropped`` rows."""
        if admit is not None and max_staleness is None:
            raise ValueError("Ledger(admit=...) needs max_staleness: without a bound every "
                             "group is admitted and the rule is never asked")
        self.mode, self.max_ahead, self.per_step = mode, max_ahead, per_step
        self.max_staleness, self.dynamic_sampling = max_staleness, dynamic_sampling
        self.admit: Admit = admit if admit is not None else RULE
        self.report = report
        self.dynamic = DynamicSampling(per_step)
        self.generators: Any = None  # the Source mesh the credits go to (:meth:`open`)
        self.version = 0  # the weight version the generators were last told
        self.issued = self.received = 0
        self.stale = 0  # groups dropped as too stale, over the run

    @property
    def outstanding(self) -> int:
        """Credits issued whose groups have not arrived yet."""
        return self.issued - self.received

    def open(self, generators: Any, version: int) -> None:
        """Start crediting ``generators``: one refill's worth (:func:`issued` of none received)."""
        self.generators = generators
        self.refill(version)

    def refill(self, version: int) -> int:
        """After a step: the generators' weights are ``version``, and every group received is
        paid for plus the steps' worth :func:`issued` allows ahead. Returns the credits issued."""
        self.version = version
        self._tell(issued(self.received, self.mode, self.max_ahead, self.per_step))
        return self.issued

    def take(self, step: int, version: int, rewards: Any = None) -> bool:
        """A group sampled with weights ``version`` arrives at ``step``: train on it? A drop (too
        stale, or flat under dynamic sampling) is counted and credited one replacement."""
        self.received += 1
        if self.max_staleness is not None and not self.admit(step, version, self.max_staleness):
            self.stale += 1
            if self.report is not None:
                self.report("dropped", step=step, staleness=staleness(step, version),
                            total=self.stale)
        elif not (self.dynamic_sampling and self.dynamic.drops(rewards)):
            return True
        self._tell(self.issued + 1)
        return False

    def _tell(self, total: int) -> None:
        self.issued = total
        if self.generators is not None:
            self.generators.progress.broadcast(self.version, total)

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps (``received`` for the record: a resumed ring's credits start
        afresh with its new generators)."""
        return {"dropped": self.stale, "received": self.received,
                "dynamic_dropped": self.dynamic.total}

    def restore(self, state: Mapping[str, Any]) -> None:
        """The run totals of a checkpoint's :meth:`state` (absent keys: 0)."""
        self.stale = int(state.get("dropped", 0))
        self.dynamic.total = int(state.get("dynamic_dropped", 0))
