"""The process side of a vLLM server: markers, the owner watchdog, orphans and reaping.

Every process of a server we start inherits two environment variables, readable from
``/proc/<pid>/environ`` by anyone of the same user::

    GRPO_NB_SERVER_ID=<id>      which server the process belongs to (API server, EngineCore …)
    GRPO_NB_OWNER_PID=<pid>     the Python process that started it (kernel, CLI, test)

A server lives in its own session (so a Ctrl-C aimed at the notebook does not kill it half-way),
which also means nothing ends it when its owner is SIGKILLed. Hence a watchdog: a small
process, child of the owner, that notices its parent changed (the owner died, however it died)
and ends the server's whole tree (:func:`watch_owner`)::

    owner ──spawn──► vLLM tree (own session, marked)
      └───spawn──► watchdog ── getppid() ≠ owner ──► SIGTERM group + marked, grace, SIGKILL
                       └────── server exited (pidfd readable) ──► exits quietly

Processes are found by their marker and ended with psutil (:func:`marked_processes`,
:func:`end_processes`), by the watchdog, ``VLLMServer.stop`` and ``doctor --reap`` alike.

``python -m grpo_nb doctor`` lists servers whose owner is gone (:func:`find_orphans`) and
``--reap`` ends them (:func:`reap`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER_ENV = "GRPO_NB_SERVER_ID"
OWNER_ENV = "GRPO_NB_OWNER_PID"

# The watchdog: a process of its own, running :func:`watch_owner`.
WATCHDOG = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from grpo_nb.serving.processes import watch_owner; watch_owner(*sys.argv[2:])")
_ROOT = str(Path(__file__).resolve().parents[2])  # where ``grpo_nb`` imports from


def start_watchdog(leader_pid: int, server_id: str, grace_s: float = 4.0
                   ) -> subprocess.Popen[bytes]:
    """Spawn the watchdog for a server whose process-group leader is ``leader_pid``."""
    env = {k: v for k, v in os.environ.items() if k not in (MARKER_ENV, OWNER_ENV)}
    return subprocess.Popen(
        [sys.executable, "-c", WATCHDOG, _ROOT, str(os.getpid()), str(leader_pid), server_id,
         str(grace_s)],
        env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def watch_owner(owner: str, leader: str, server_id: str, grace_s: str) -> None:
    """The watchdog's body: return when the server exits; when the owner does (the parent
    changes), end the server's tree as :meth:`VLLMServer.stop` does.

    Why getppid and not PR_SET_PDEATHSIG: the death signal follows the *thread* that spawned
    the child, and servers are often started from asyncio.to_thread, whose threads come and go.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fd: int | None = os.pidfd_open(int(leader))
    except ProcessLookupError:  # the server is gone already
        return
    except (AttributeError, OSError):  # no pidfd (not Linux): only the owner is watched
        fd = None
    while os.getppid() == int(owner):
        if fd is None:
            time.sleep(0.25)
        elif select.select([fd], [], [], 0.25)[0]:
            return
    end_processes(marked_processes([server_id]), int(leader), float(grace_s))


async def wait_exit(proc: subprocess.Popen[bytes]) -> int:
    """Wait until ``proc`` exits, without polling (a pidfd in the event loop; where there is
    none, a daemon thread waits); its exit code."""
    loop, done = asyncio.get_running_loop(), asyncio.Event()
    fd = None
    try:
        fd = os.pidfd_open(proc.pid)
        loop.add_reader(fd, done.set)
    except ProcessLookupError:  # already reaped
        return proc.wait()
    except (AttributeError, OSError):
        def wait() -> None:
            proc.wait()
            with contextlib.suppress(RuntimeError):  # the loop closed first: nobody listens
                loop.call_soon_threadsafe(done.set)

        threading.Thread(target=wait, daemon=True).start()
    try:
        await done.wait()
    finally:
        if fd is not None:
            loop.remove_reader(fd)
            os.close(fd)
    return proc.wait()


def marked_processes(server_ids: Iterable[str] | None = None) -> list[Any]:
    """``psutil.Process`` objects carrying a server marker (of ``server_ids``, or any)."""
    import psutil

    ids = None if server_ids is None else set(server_ids)
    if ids is not None and not ids:
        return []
    found = []
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            marker = p.environ().get(MARKER_ENV)
            if marker and (ids is None or marker in ids) and p.pid != os.getpid():
                found.append(p)
    return found


def end_processes(procs: list[Any], leader_pid: int | None, timeout: float) -> None:
    """SIGTERM the group and ``procs``, wait up to ``timeout``, SIGKILL what is left."""
    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        if leader_pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(leader_pid, sig)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        _, procs = psutil.wait_procs(procs, timeout=timeout if sig == signal.SIGTERM else 5)


@dataclass
class Orphan:
    """A server started by grpo_nb whose owner process is gone."""

    server_id: str
    owner_pid: int
    pids: list[int]
    port: str
    model: str
    rss_gib: float


def _owner_alive(owner: int, since: float) -> bool:
    import psutil

    try:
        p = psutil.Process(owner)
        # A reused pid (created after the server) is not the owner.
        return p.status() != psutil.STATUS_ZOMBIE and p.create_time() <= since + 1
    except psutil.Error:
        return False


def _arg(cmdline: list[str], flag: str) -> str:
    return cmdline[cmdline.index(flag) + 1] if flag in cmdline[:-1] else "?"


def _marked_groups() -> dict[str, tuple[int, list[Any]]]:
    """Marked processes grouped by server marker, each group with its ``GRPO_NB_OWNER_PID``."""
    import psutil

    groups: dict[str, tuple[int, list[Any]]] = {}
    for p in marked_processes():
        with contextlib.suppress(psutil.Error, ValueError):
            env = p.environ()
            owner = int(env[OWNER_ENV])
            groups.setdefault(env[MARKER_ENV], (owner, []))[1].append(p)
    return groups


def owned_by(pid: int) -> list[Any]:
    """The marked server processes started for owner ``pid``."""
    return [p for owner, procs in _marked_groups().values() if owner == pid for p in procs]


def find_orphans() -> list[Orphan]:
    """Servers (grouped by marker) whose ``GRPO_NB_OWNER_PID`` is no longer running."""
    import psutil

    orphans = []
    for sid, (owner, procs) in _marked_groups().items():
        with contextlib.suppress(psutil.Error):
            oldest = min(p.create_time() for p in procs)
            if _owner_alive(owner, oldest):
                continue
            cmd = max((p.cmdline() for p in procs), key=lambda c: "--port" in c)
            rss = sum(p.memory_info().rss for p in procs) / 2**30
            orphans.append(Orphan(sid, owner, sorted(p.pid for p in procs),
                                  _arg(cmd, "--port"), _arg(cmd, "--model"), round(rss, 2)))
    return orphans


def reap(orphans: list[Orphan], timeout: float = 10.0) -> list[int]:
    """End every process of ``orphans``; returns the pids that were signalled."""
    procs = marked_processes([o.server_id for o in orphans])
    end_processes(procs, None, timeout)
    return sorted(p.pid for p in procs)
