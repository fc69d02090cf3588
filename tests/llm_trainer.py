"""A real :class:`grpo_nb.llm.actors.Trainer` built through its constructor on a model folder,
with no server (its syncer connects only when a sync is asked), for tests of its collection and
finish paths; stopped (``__cleanup__``, which puts back its process-wide torch settings) when
the block ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import RingSpec
from grpo_nb.ring_core import Admit


class Null:
    """A metrics port that drops what it is sent."""

    def send(self, _event: Any) -> None:
        pass


class Credits:
    """Stands for the generators' mesh: records each ``progress(version, issued)`` broadcast."""

    def __init__(self) -> None:
        self.told: list[tuple[int, int]] = []
        self.progress = self

    def broadcast(self, version: int, issued: int) -> None:
        self.told.append((version, issued))

    @property
    def totals(self) -> list[int]:
        return [n for _, n in self.told]


@contextlib.contextmanager
def built_trainer(model_dir: Path, cfg: LLMConfig, *, admit: Admit | None = None,
                  groups: Iterable[Any] = (), step: int = 0,
                  issued: int | None = None) -> Iterator[Any]:
    """The trainer at ``step`` (its weights version ``step``), ``groups`` queued on its inlet,
    its ledger crediting a :class:`Credits` (``trainer.ledger.generators``) from ``issued``
    credits (default: one step's worth); rows it reports land in ``trainer.rows``."""
    from grpo_nb.llm.actors import Trainer

    spec = RingSpec("http://127.0.0.1:9", "m", str(model_dir), [])
    cfg = cfg.resolve()  # as train() hands it to the ring
    t = Trainer(cfg, spec, Null(), admit)
    try:
        t.rows = []
        t.report = t.ledger.report = lambda kind, **data: t.rows.append({"kind": kind, **data})
        t.pt.step_count = t.pt.version = t.ledger.version = step
        t.ledger.generators = Credits()
        t.ledger.issued = cfg.prompts_per_step if issued is None else issued
        for g in groups:
            t.port.send(g)
        yield t
    finally:
        t.next_msg = None  # a receive left on a test's closed event loop cannot be cancelled
        asyncio.run(t.__cleanup__(None))  # as the actor runtime stops it
