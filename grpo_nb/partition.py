"""Who runs on which CPU core: the vLLM server tree on its own core(s), the trainer on the rest.

On a CPU-only machine the server and the trainer compete for the same few cores. vLLM's engine
spin-waits (``sched_yield``) while it generates and its OpenMP threads want a whole core each;
an unpinned trainer lands on the same core half the time, and then neither runs at speed, so
generation and training cannot overlap — which is the whole point of asynchronous GRPO. A
partition gives each side its own cores::

    plan(cpus=(0, 1))  ──►  Plan(server_cpus=(1,), trainer_cpus=(0,), trainer_threads=1)
        │                        │                              │
        │   VLLMServer.start ────┘ every process of the tree    │ apply_to_this_process /
        │   (ServerConfig.cpus="auto")   inherits the mask       │ pinned(): every thread of
        │                                                       │ this process + torch threads
        ▼
    default: a CPU-only machine with ≥ 2 cores → the server gets the last core. Off on a GPU
    (the GPU does the work there), on one core, or with ``GRPO_NB_SERVER_CPUS=off``; a list
    such as ``GRPO_NB_SERVER_CPUS=2-3`` (or ``plan(server_cpus="2-3")``) chooses the cores.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "GRPO_NB_SERVER_CPUS"  # "auto" (default), "off", or a core list such as "1" or "2-3,5"

CpuSpec = str | Sequence[int] | None


@dataclass(frozen=True)
class Plan:
    """Where the server tree and the trainer run; ``None`` everywhere: no partition."""

    server_cpus: tuple[int, ...] | None
    trainer_cpus: tuple[int, ...] | None
    trainer_threads: int | None
    why: str = ""

    @property
    def active(self) -> bool:
        return self.server_cpus is not None

    def describe(self) -> str:
        """One line for ``doctor`` and logs."""
        if not self.active:
            return f"off ({self.why})"
        return (f"vLLM server on core(s) {format_cpus(self.server_cpus)}, trainer on "
                f"{format_cpus(self.trainer_cpus)} with {self.trainer_threads} torch "
                f"thread(s) ({self.why})")


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on (a container or ``taskset`` may allow fewer)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def parse_cpus(text: str, field: str = "cpus") -> tuple[int, ...]:
    """``"0,2-3"`` → ``(0, 2, 3)``; errors name ``field``."""
    out: set[int] = set()
    try:
        for part in text.replace(" ", "").split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{field}={text!r}: use 'auto', 'off' or core ids like '1' or "
                         "'2-3,5'") from None
    if not out:
        raise ValueError(f"{field}={text!r}: names no core")
    return tuple(sorted(out))


def format_cpus(cpus: Sequence[int] | None) -> str:
    """``(0, 2, 3)`` → ``"0,2-3"`` (the form of ``Cpus_allowed_list``)."""
    if not cpus:
        return "-"
    ranges: list[list[int]] = []
    for c in sorted(cpus):
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def check_spec(spec: CpuSpec, field: str) -> None:
    """Validate a cpu spec (``"auto"``, ``"off"``, ``None``, a list string or ints)."""
    if spec is None or spec in ("auto", "off"):
        return
    if isinstance(spec, str):
        parse_cpus(spec, field)
        return
    if isinstance(spec, bool) or not all(isinstance(c, int) and not isinstance(c, bool)
                                         and c >= 0 for c in spec) or not list(spec):
        raise ValueError(f"{field}={spec!r}: 'auto', 'off', or a non-empty list of core ids ≥ 0")


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def plan(cpus: int | Sequence[int] | None = None, server_cpus: CpuSpec = None, *,
         gpu: bool | None = None) -> Plan:
    """The partition for a machine with ``cpus`` (a count or core ids; default: the cores this
    process may use). ``server_cpus``: ``"auto"``, ``"off"`` or cores (default
    ``$GRPO_NB_SERVER_CPUS``, else ``"auto"``). ``gpu`` default: is CUDA available."""
    if isinstance(cpus, int):
        allowed = tuple(range(cpus))
    else:
        allowed = tuple(sorted(cpus)) if cpus else available_cpus()
    spec = server_cpus if server_cpus is not None else (os.environ.get(ENV) or "auto")
    field = "server_cpus" if server_cpus is not None else ENV
    check_spec(spec, field)
    if spec == "off":
        return Plan(None, None, None, f"{field}=off")
    if spec == "auto":
        if gpu if gpu is not None else _gpu_available():
            return Plan(None, None, None, "a GPU does the work; CPU cores are not partitioned")
        if len(allowed) < 2:
            return Plan(None, None, None, f"only {len(allowed)} core")
        return _split(allowed, (allowed[-1],), f"auto: the last of {len(allowed)} cores")
    chosen = parse_cpus(spec, field) if isinstance(spec, str) else tuple(sorted(set(spec)))
    if not set(chosen) <= set(allowed):
        raise ValueError(f"{field}={spec!r}: cores {format_cpus(set(chosen) - set(allowed))} "
                         f"are not among this process's cores {format_cpus(allowed)}")
    if set(chosen) == set(allowed):
        raise ValueError(f"{field}={spec!r} takes every core ({format_cpus(allowed)}): leave "
                         "at least one for the trainer, or use 'off'")
    return _split(allowed, chosen, f"{field}={spec}")


def beside(server_cpus: Sequence[int] | None) -> Plan:
    """The trainer's side of a server tree already pinned to ``server_cpus``: the other cores
    this process may use. No partition when the server is not pinned (``None``: it runs on a
    GPU, on one core, or with ``cpus="off"``) or when no core is left beside it."""
    if not server_cpus:
        return Plan(None, None, None, "the server tree is not pinned")
    trainer = tuple(c for c in available_cpus() if c not in set(server_cpus))
    if not trainer:
        return Plan(None, None, None, f"no core left beside the server's "
                                      f"{format_cpus(server_cpus)}")
    return _split(tuple(sorted({*trainer, *server_cpus})), tuple(sorted(server_cpus)),
                  f"beside the server tree on {format_cpus(server_cpus)}")


def _split(allowed: tuple[int, ...], server: tuple[int, ...], why: str) -> Plan:
    trainer = tuple(c for c in allowed if c not in server)
    return Plan(tuple(server), trainer, len(trainer), why)


# ── applying it ──


def _threads() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")] if Path("/proc/self/task").is_dir() \
        else [0]


def set_affinity_all_threads(cpus: Sequence[int]) -> None:
    """Pin every thread of this process: ``sched_setaffinity(0)`` moves only the calling
    thread, while the event loop's helpers, torch's pool and the kernel's threads exist
    already and would keep running anywhere."""
    for tid in _threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


def apply_to_this_process(p: Plan) -> tuple[tuple[int, ...], int | None] | None:
    """Pin this process (every thread) to ``p.trainer_cpus`` and set torch's thread count.

    Returns the previous ``(cpus, torch threads)`` for :func:`restore`, or ``None`` when the
    plan is off (nothing changed)."""
    if not p.active:
        return None
    before = (available_cpus(), _torch_threads())
    set_affinity_all_threads(p.trainer_cpus)
    if "torch" in sys.modules or _has_torch():
        import torch

        torch.set_num_threads(p.trainer_threads)
    return before


def restore(before: tuple[tuple[int, ...], int | None] | None) -> None:
    """Undo :func:`apply_to_this_process` (a notebook kernel lives on after the run)."""
    if before is None:
        return
    cpus, threads = before
    set_affinity_all_threads(cpus)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


@contextlib.contextmanager
def pinned(p: Plan) -> Iterator[Plan]:
    """``with pinned(plan):`` this process runs on the trainer's cores, then as before."""
    before = apply_to_this_process(p)
    try:
        yield p
    finally:
        restore(before)


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _torch_threads() -> int | None:
    if "torch" not in sys.modules and not _has_torch():
        return None
    import torch

    return torch.get_num_threads()


def exec_pinned(cpus: Sequence[int], cmd: list[str]) -> list[str]:
    """``cmd`` started through a tiny trampoline that pins itself, then ``exec``\\ s ``cmd``:
    the pid stays, and every process and thread vLLM creates inherits the mask. (Not
    ``preexec_fn``: Python code between fork and exec can deadlock in a threaded parent,
    such as a notebook kernel.)"""
    mask = ",".join(str(int(c)) for c in cpus)
    code = f"import os,sys;os.sched_setaffinity(0,{{{mask}}});os.execv(sys.argv[1],sys.argv[1:])"
    return [sys.executable, "-S", "-c", code, *cmd]


def server_env(cpus: Sequence[int]) -> dict[str, str]:
    """vLLM's CPU backend binds one OpenMP thread per listed core; without these it reserves
    a core for its scheduler and picks the worker's cores itself, ignoring our mask."""
    return {"VLLM_CPU_OMP_THREADS_BIND": format_cpus(cpus), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def allowed_list(pid: int | str, tid: int | str | None = None) -> tuple[int, ...]:
    """``Cpus_allowed_list`` of a process (or one of its threads) from ``/proc``."""
    path = Path(f"/proc/{pid}") / (f"task/{tid}" if tid is not None else "") / "status"
    for line in path.read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpus(line.split(":", 1)[1].strip(), "Cpus_allowed_list")
    raise RuntimeError(f"{path}: no Cpus_allowed_list")
