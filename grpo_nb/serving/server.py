"""Start, watch and stop a vLLM OpenAI-compatible server as a subprocess.

vLLM's server is a tree of processes (API server → EngineCore → worker). It is started in a
fresh process group, so that :meth:`VLLMServer.stop` ends the whole tree at once, whether the
notebook cell finished, raised, or was interrupted::

    ServerConfig ──► VLLMServer(cfg)  (registered before anything is spawned)
                          │ .start() / await .start_async() / with / async with
                          ├─spawn─► python -m vllm.entrypoints.openai.api_server
                          │           (own process group, marked, log → runs/vllm/*.log,
                          │            pinned to ServerConfig.cpus: grpo_nb.partition)
                          ├─spawn─► watchdog: owner died (even SIGKILL) → ends the tree
                          ├── polls GET /health; died / timed out → ServerStartError(log tail)
                          ▼
                     .url / .base_url / .api_key ──► client.CompletionsClient
                          │
                     .stop() / with-block / atexit ──► SIGTERM group → wait → SIGKILL group

Servers are kept in a module-level registry (strong references): re-running a notebook cell
that starts a server does not orphan the previous one; it keeps running until ``stop()``,
:func:`stop_all` or interpreter exit, or until a server with the same ``ServerConfig.name``
starts. In ``asyncio`` code use ``await server.start_async()`` (a cancelled start stops the
server); ``await asyncio.to_thread(server.start)`` cannot be interrupted — if you must, create
the server first and call ``server.stop()`` in an ``except BaseException`` around it.

Safety (see :mod:`grpo_nb.serving.server_config`): a dev-mode server (weight routes on) is
loopback-only, key or not; the API key travels by environment and is redacted from the log
tails we print.

CPU and GPU run the same code: only the defaults differ (``VLLM_TARGET_DEVICE=cpu``, float32 and
a small KV cache on CPU; the checkpoint's dtype and a memory fraction on GPU).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from grpo_nb.config import runs_dir
from grpo_nb.partition import exec_pinned
from grpo_nb.serving.net import free_port, http, is_loopback
from grpo_nb.serving.processes import (
    MARKER_ENV,
    end_processes,
    marked_processes,
    start_watchdog,
    wait_exit,
)
from grpo_nb.serving.server_config import ServerConfig, env_api_key

__all__ = ["ServerConfig", "ServerStartError", "VLLMServer", "find_server_processes",
           "free_port", "is_loopback", "stop_all", "MARKER_ENV"]

STARTED_IDS: list[str] = []  # ids of every server this Python process started
_LIVE: set[VLLMServer] = set()  # strong: a dropped variable must not orphan a running server
_BY_NAME: dict[str, VLLMServer] = {}


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message ends with its log's tail."""


def log_tail(path: Path | None, lines: int = 30, secret: str | None = None) -> str:
    """The log's last ``lines``, with ``secret`` (the API key) replaced by ``***``."""
    if path is None or not path.is_file():
        return "(no log)"
    text = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return text.replace(secret, "***") if secret else text


def _get(url: str, api_key: str | None, timeout: float = 2.0) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    resp = http().get(url, headers=headers, timeout=timeout)
    return resp.status_code, resp.text


class VLLMServer:
    """A vLLM server this process owns (``start``/``stop``), or one it attached to (``attach``).

    Use as a context manager (``with`` / ``async with``) or call ``start()`` (or
    ``await start_async()``) and ``stop()``; servers still running when Python exits are
    stopped by an ``atexit`` hook, and a watchdog stops them if this process is killed.
    """

    def __init__(self, cfg: ServerConfig | None, *, _owned: bool = True) -> None:
        if cfg is not None and not cfg.model:
            raise ValueError("ServerConfig.model is empty: pass a model folder or hub name")
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None
        self.port: int = cfg.port if cfg else 0
        self.host: str = cfg.host if cfg else ""
        self.api_key = cfg.api_key if cfg else None
        self.model_name = (cfg.served_model_name or cfg.model) if cfg else ""
        self.server_id = uuid.uuid4().hex[:12] if _owned else ""
        self.log_path: Path | None = None
        self.startup_seconds: float | None = None
        self.cpus: tuple[int, ...] | None = None  # the cores of the tree (None: unpinned)
        self._owned = _owned
        self._stopped = False
        self._lock = threading.RLock()  # spawn and stop never interleave (start thread vs stop)

    # ------------------------------------------------------------------ addresses
    @property
    def url(self) -> str:
        """``http://host:port`` (the admin routes: /health, /pause, /update_weights …)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """``http://host:port/v1`` (the OpenAI API)."""
        return f"{self.url}/v1"

    @classmethod
    def attach(cls, url: str, *, api_key: str | None = None, timeout: float = 10.0) -> VLLMServer:
        """Use a server someone else runs: checks ``/health`` and reads the served model name.

        ``api_key`` defaults to ``$VLLM_API_KEY``. ``stop()`` on an attached server does
        nothing: it is not ours to end.
        """
        url = url.rstrip("/").removesuffix("/v1")
        host, _, port = url.split("://", 1)[-1].rpartition(":")
        server = cls(None, _owned=False)
        server.host, server.port, server.api_key = host, int(port), api_key or env_api_key()
        try:
            status, _ = _get(f"{url}/health", server.api_key, timeout)
            if status != 200:
                raise ConnectionError(f"{url}/health answered {status}")
            status, body = _get(f"{url}/v1/models", server.api_key, timeout)
            if status != 200:
                raise ConnectionError(f"{url}/v1/models answered {status}: {body[:200]}")
        except httpx.TransportError as err:
            raise ConnectionError(f"no vLLM server reachable at {url}: {err}") from err
        server.model_name = json.loads(body)["data"][0]["id"]
        return server

    # ------------------------------------------------------------------ lifecycle
    def is_running(self) -> bool:
        if self.proc is None:
            return not self._owned and self.healthy()
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return _get(f"{self.url}/health", self.api_key, timeout=2.0)[0] == 200
        except httpx.TransportError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines, self.api_key)

    def _spawn(self) -> None:
        """Validate, register, spawn the server and its watchdog (fast; no waiting)."""
        with self._lock:
            if not self._owned:
                raise RuntimeError("an attached server cannot be started")
            if self._stopped or self.proc is not None:
                raise RuntimeError("server already started or stopped: create a new VLLMServer")
            self.cfg.validate()  # fields may have been set after construction
            self.api_key = self.cfg.api_key
            if self.cfg.name and (old := _BY_NAME.get(self.cfg.name)) is not None:
                print(f"stopping the previous server named {self.cfg.name!r} ({old.url})")
                old.stop()
            gpu = _gpu_available()
            self.port = self.cfg.port or free_port(self.cfg.host)
            log_dir = Path(self.cfg.log_dir) if self.cfg.log_dir else runs_dir() / "vllm"
            log_dir.mkdir(parents=True, exist_ok=True)
            self.log_path = log_dir / f"server-{time.strftime('%Y%m%d-%H%M%S')}-{self.port}.log"
            cmd = self.cfg.command(self.port, gpu)
            self.cpus = self.cfg.resolve_cpus(gpu)
            if self.cpus:  # pinned before exec: every process and thread of the tree inherits
                cmd = exec_pinned(self.cpus, cmd)
            _LIVE.add(self)
            if self.cfg.name:
                _BY_NAME[self.cfg.name] = self
            with self.log_path.open("wb") as log:
                log.write(("$ " + " ".join(cmd) + "\n").encode())
                log.flush()
                self.proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=self.cfg.environment(self.server_id, gpu, self.cpus),
                    start_new_session=True)
            STARTED_IDS.append(self.server_id)
            self.watchdog = start_watchdog(self.proc.pid, self.server_id)

    def _started(self, t0: float) -> bool:
        """One health check: ``True`` when healthy; raises when it cannot become healthy."""
        elapsed = time.perf_counter() - t0
        if self._stopped:
            raise ServerStartError(f"server stopped while starting (after {elapsed:.0f} s)")
        if self.proc.poll() is not None:
            raise ServerStartError(
                f"vLLM exited with code {self.proc.returncode} after {elapsed:.0f} s; "
                f"log {self.log_path}:\n{self.log_tail()}")
        if elapsed > self.cfg.startup_timeout:
            raise ServerStartError(
                f"vLLM not healthy after {self.cfg.startup_timeout:.0f} s "
                f"(ServerConfig.startup_timeout); log {self.log_path}:\n{self.log_tail()}")
        if self.healthy():
            self.startup_seconds = round(elapsed, 1)
            return True
        return False

    def _bar(self, progress: bool) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=None, desc=f"vLLM :{self.port}", disable=not progress,
                    bar_format="{desc} {elapsed} {postfix}", leave=False)

    def _show(self, bar: Any) -> None:
        last = self.log_tail(5).strip().splitlines()
        bar.set_postfix_str(last[-1][-120:] if last else "", refresh=False)
        bar.update(0)

    def start(self, *, progress: bool = True) -> VLLMServer:
        """Spawn the server and wait for ``/health``; raises :class:`ServerStartError`."""
        try:
            self._spawn()
            t0 = time.perf_counter()
            with contextlib.closing(self._bar(progress)) as bar:
                while not self._started(t0):
                    self._show(bar)
                    time.sleep(0.5)
        except BaseException:  # includes KeyboardInterrupt: never leave a half-started server
            self.stop()
            raise
        return self

    async def start_async(self, *, progress: bool = False) -> VLLMServer:
        """:meth:`start` for ``asyncio`` code: cancelling the awaiting task stops the server."""
        try:
            await asyncio.to_thread(self._spawn)
            t0 = time.perf_counter()
            with contextlib.closing(self._bar(progress)) as bar:
                while not await asyncio.to_thread(self._started, t0):
                    self._show(bar)
                    await asyncio.sleep(0.5)
        except BaseException:  # CancelledError too; stop() waits for a spawn in flight
            self.stop()
            raise
        return self

    async def wait_exited(self) -> int:
        """Wait (without polling: :func:`processes.wait_exit`) until the server exits; its code."""
        if self.proc is None:
            raise RuntimeError("wait_exited(): this server was not started by this process")
        return await wait_exit(self.proc)

    def pids(self) -> list[int]:
        """Every process of this server (found by the marker in their environment)."""
        return [p.pid for p in find_server_processes([self.server_id])] if self._owned else []

    def stop(self, timeout: float = 20.0) -> None:
        """End the whole process tree: SIGTERM the group, wait, then SIGKILL what is left."""
        with self._lock:
            self._stopped = True
            if self._owned and self.proc is not None:
                end_processes(find_server_processes([self.server_id]), self.proc.pid, timeout)
                # a child forked while the group was signalled got SIGTERM too, but nobody
                # waited for it: wait now (SIGKILL if it lingers)
                end_processes(find_server_processes([self.server_id]), None, 5)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=5)
            if self.watchdog is not None:
                self.watchdog.kill()
                self.watchdog.wait()
            _LIVE.discard(self)
            if self.cfg is not None and self.cfg.name and _BY_NAME.get(self.cfg.name) is self:
                del _BY_NAME[self.cfg.name]

    def __enter__(self) -> VLLMServer:
        if self._owned and self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> VLLMServer:
        if self._owned and self.proc is None:
            await self.start_async()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        state = "attached" if not self._owned else ("running" if self.is_running() else "stopped")
        return f"VLLMServer({self.model_name!r}, {self.url}, {state})"


def find_server_processes(server_ids: list[str] | None = None) -> list[Any]:
    """Processes carrying the marker of one of ``server_ids`` (default: all this process
    started). Used by ``stop()`` and by the tests' "no vLLM left behind" check."""
    return marked_processes(STARTED_IDS if server_ids is None else server_ids)


@atexit.register
def stop_all() -> None:
    """Stop every server this process started and has not stopped (also runs at exit)."""
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(timeout=5)
