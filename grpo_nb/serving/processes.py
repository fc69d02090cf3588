"""A vLLM server's processes: every one inherits ``GRPO_NB_SERVER_ID`` and ``GRPO_NB_OWNER_PID``,
so psutil finds its whole tree for ``stop``, the owner watchdog and ``doctor --reap`` alike."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

MARKER_ENV = "GRPO_NB_SERVER_ID"
OWNER_ENV = "GRPO_NB_OWNER_PID"

# The watchdog: a process of its own, running :func:`watch_owner`.
WATCHDOG = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from grpo_nb.serving.processes import watch_owner; watch_owner(*sys.argv[2:])")
_ROOT = str(Path(__file__).resolve().parents[2])  # where ``grpo_nb`` imports from


async def wait_exit(pid: int) -> None:
    """Return once process ``pid`` has exited, without reaping it (a pidfd, else a poll)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):
        with contextlib.suppress(psutil.NoSuchProcess):
            while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                await asyncio.sleep(0.25)
        return
    loop, done = asyncio.get_running_loop(), asyncio.Event()
    loop.add_reader(fd, done.set)
    try:
        await done.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def start_watchdog(leader_pid: int, server_id: str) -> subprocess.Popen[bytes]:
    """Spawn the watchdog for a server whose process-group leader is ``leader_pid``."""
    env = {k: v for k, v in os.environ.items() if k not in (MARKER_ENV, OWNER_ENV)}
    return subprocess.Popen(
        [sys.executable, "-c", WATCHDOG, _ROOT, str(os.getpid()), str(leader_pid), server_id],
        env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def watch_owner(owner: str, leader: str, server_id: str) -> None:
    """The watchdog's body: when the owner exits before the server (SIGKILL included), end
    the server's tree (not PR_SET_PDEATHSIG: it follows the spawning *thread*)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def owner_exits_first() -> bool:  # asyncio.run cancels the other wait
        if os.getppid() != int(owner):  # the owner died before this process ran
            return True
        owner_exit = asyncio.ensure_future(wait_exit(int(owner)))
        done, _ = await asyncio.wait({owner_exit, asyncio.ensure_future(wait_exit(int(leader)))},
                                     return_when=asyncio.FIRST_COMPLETED)
        return owner_exit in done

    if asyncio.run(owner_exits_first()):
        end_processes(marked_processes([server_id]), int(leader), timeout=4.0)


def _marked() -> Iterator[tuple[psutil.Process, str, str]]:
    """Every marked process of this user but ours: (process, server id, owner pid)."""
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = p.environ()
            if env.get(MARKER_ENV) and p.pid != os.getpid():
                yield p, env[MARKER_ENV], env.get(OWNER_ENV, "")


def marked_processes(server_ids: Iterable[str]) -> list[psutil.Process]:
    ids = set(server_ids)
    return [p for p, sid, _ in _marked() if sid in ids]


def listening_on(server_id: str, port: int) -> bool:
    """Whether a process of server ``server_id`` listens on TCP ``port`` (what answers there
    may be another process that took the port first: another vLLM answers /health too)."""
    for proc in marked_processes([server_id]):
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in proc.net_connections("tcp")):
                return True
    return False


def owned_by(pid: int) -> list[psutil.Process]:
    """The processes of every server started by process ``pid``."""
    return [p for p, _, owner in _marked() if owner == str(pid)]


def end_processes(procs: list[psutil.Process], leader_pid: int | None, timeout: float) -> None:
    """SIGTERM the group and ``procs``, wait up to ``timeout``, SIGKILL what is left."""
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


def _arg(cmdline: list[str], flag: str) -> str:
    return cmdline[cmdline.index(flag) + 1] if flag in cmdline[:-1] else "?"


def find_orphans() -> list[Orphan]:
    """Servers (grouped by marker) whose ``GRPO_NB_OWNER_PID`` is no longer running."""
    groups: dict[str, tuple[str, list[psutil.Process]]] = {}
    for p, sid, owner in _marked():
        groups.setdefault(sid, (owner, []))[1].append(p)
    orphans = []
    for sid, (owner, procs) in groups.items():
        with contextlib.suppress(psutil.Error, ValueError):
            since = min(p.create_time() for p in procs)
            with contextlib.suppress(psutil.Error):  # no such process: the owner is gone
                o = psutil.Process(int(owner))
                # neither a zombie nor a reused pid (created after the server) is the owner
                if o.status() != psutil.STATUS_ZOMBIE and o.create_time() <= since + 1:
                    continue
            cmd = max((p.cmdline() for p in procs), key=lambda c: "--port" in c)
            rss = sum(p.memory_info().rss for p in procs) / 2**30
            orphans.append(Orphan(sid, int(owner), sorted(p.pid for p in procs),
                                  _arg(cmd, "--port"), _arg(cmd, "--model"), round(rss, 2)))
    return orphans


def reap(orphans: list[Orphan], timeout: float = 10.0) -> list[int]:
    """End every process of ``orphans``; returns the pids that were signalled."""
    procs = marked_processes([o.server_id for o in orphans])
    end_processes(procs, None, timeout)
    return sorted(p.pid for p in procs)
