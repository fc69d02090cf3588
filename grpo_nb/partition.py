"""Who runs on which CPU core: the vLLM server tree on its own core(s), the trainer on the rest
(vLLM-CPU spin-waits, so sharing a core stalls both). By default a CPU-only machine with 2+
cores gives the server its last core; ``GRPO_NB_SERVER_CPUS=off`` or a core list overrides it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

ENV = "GRPO_NB_SERVER_CPUS"  # "auto" (default), "off", or a core list such as "1" or "2-3,5"


@dataclass(frozen=True)
class Plan:
    """Where the server tree and the trainer run; ``None`` everywhere: no partition."""

    server_cpus: tuple[int, ...] | None = None
    trainer_cpus: tuple[int, ...] | None = None
    trainer_threads: int | None = None
    why: str = ""

    @property
    def active(self) -> bool:
        return self.server_cpus is not None

    def describe(self) -> str:
        """One line for ``doctor`` and logs."""
        if not self.active:
            threads = ("" if self.trainer_threads is None
                       else f"; trainer with {self.trainer_threads} torch thread(s)")
            return f"off ({self.why}){threads}"
        return (f"vLLM server on core(s) {format_cpus(self.server_cpus)}, trainer on "
                f"{format_cpus(self.trainer_cpus)} with {self.trainer_threads} torch "
                f"thread(s) ({self.why})")


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on (a container or ``taskset`` may allow fewer)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def parse_cpus(spec: str | Sequence[int], field: str = "cpus") -> tuple[int, ...]:
    """``"0,2-3"`` or ``[3, 0, 2]`` → ``(0, 2, 3)``; errors name ``field``."""
    if not isinstance(spec, str):
        if isinstance(spec, bool) or not spec or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in spec):
            raise ValueError(f"{field}={spec!r}: 'auto', 'off', or a non-empty list of core "
                             "ids ≥ 0")
        return tuple(sorted(set(spec)))
    out: set[int] = set()
    try:
        for part in spec.replace(" ", "").split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{field}={spec!r}: use 'auto', 'off' or core ids like '1' or "
                         "'2-3,5'") from None
    if not out:
        raise ValueError(f"{field}={spec!r}: names no core")
    return tuple(sorted(out))


def format_cpus(cpus: Sequence[int] | None) -> str:
    """``(0, 2, 3)`` → ``"0,2-3"`` (the form of ``Cpus_allowed_list``)."""
    ranges: list[list[int]] = []
    for c in sorted(cpus or ()):
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) or "-"


def plan(cpus: int | Sequence[int] | None = None,
         server_cpus: str | Sequence[int] | None = None, *, gpu: bool | None = None) -> Plan:
    """The partition for ``cpus`` (a count or core ids; default: this process's cores);
    ``server_cpus`` defaults to ``$GRPO_NB_SERVER_CPUS``, else ``"auto"``."""
    allowed = tuple(range(cpus)) if isinstance(cpus, int) else tuple(sorted(cpus or available_cpus()))
    spec = server_cpus if server_cpus is not None else (os.environ.get(ENV) or "auto")
    field = "server_cpus" if server_cpus is not None else ENV
    if spec == "off":
        return Plan(why=f"{field}=off")
    if spec == "auto":
        if gpu if gpu is not None else cuda_available():
            return Plan(why="a GPU does the work; CPU cores are not partitioned")
        if len(allowed) < 2:
            return Plan(why=f"only {len(allowed)} core")
        return _split(allowed, (allowed[-1],), f"auto: the last of {len(allowed)} cores")
    chosen = parse_cpus(spec, field)
    if not set(chosen) <= set(allowed):
        raise ValueError(f"{field}={spec!r}: cores {format_cpus(set(chosen) - set(allowed))} "
                         f"are not among this process's cores {format_cpus(allowed)}")
    if set(chosen) == set(allowed):
        raise ValueError(f"{field}={spec!r} takes every core ({format_cpus(allowed)}): leave "
                         "at least one for the trainer, or use 'off'")
    return _split(allowed, chosen, f"{field}={spec}")


def beside(server_cpus: Sequence[int] | None) -> Plan:
    """The trainer's side of a server tree already pinned to ``server_cpus``: the other cores."""
    if not server_cpus:
        return Plan(why="the server tree is not pinned")
    server = tuple(sorted(server_cpus))
    allowed = tuple(sorted({*available_cpus(), *server}))
    if allowed == server:
        return Plan(why=f"no core left beside the server's {format_cpus(server)}")
    return _split(allowed, server, f"beside the server tree on {format_cpus(server)}")


def _split(allowed: tuple[int, ...], server: tuple[int, ...], why: str) -> Plan:
    trainer = tuple(c for c in allowed if c not in server)
    return Plan(tuple(server), trainer, len(trainer), why)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _pin_all_threads(cpus: Sequence[int]) -> None:
    # sched_setaffinity(0) moves only the calling thread; the event loop's helpers and
    # torch's pool exist already and would keep running anywhere.
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def torch_settings(threads: int | None = None, seed: int | None = None) -> Iterator[None]:
    """Within it, torch runs ``threads`` threads and (with ``seed``) its generators start from
    ``seed``; after it, also on error, the thread count and (with ``seed``) the generators'
    states are as before: a notebook kernel that ran a trainer keeps its own settings."""
    import torch

    before, rng, cuda = torch.get_num_threads(), None, None
    if seed is not None:
        rng = torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    if threads is not None:
        torch.set_num_threads(threads)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if rng is not None:
            torch.random.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def pinned(p: Plan) -> Iterator[Plan]:
    """Every thread of this process on the trainer's cores, with the plan's torch threads, inside
    the block; then both as before."""
    if not p.active:
        yield p
        return
    cpus = available_cpus()
    _pin_all_threads(p.trainer_cpus)
    try:
        with torch_settings(p.trainer_threads):
            yield p
    finally:
        _pin_all_threads(cpus)
