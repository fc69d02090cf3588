"""Start, watch and stop a vLLM server as a process tree in its own group; a registry keeps every
server until stopped, so re-running a cell never orphans one."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx

from grpo_nb.config import runs_dir
from grpo_nb.partition import cuda_available, exec_pinned, plan
from grpo_nb.serving.net import auth_headers, env_api_key, free_port, http
from grpo_nb.serving.processes import end_processes, marked_processes, start_watchdog
from grpo_nb.serving.server_config import ServerConfig

_LIVE: set[VLLMServer] = set()  # strong: a dropped variable must not orphan a running server
_BY_NAME: dict[str, VLLMServer] = {}


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message ends with its log's tail."""


class VLLMServer:
    """A vLLM server this process owns (``with``, or ``start()`` / ``stop()``) or attached to."""

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
        """Use a server someone else runs (``stop()`` leaves it running)."""
        url = url.rstrip("/").removesuffix("/v1")
        host, _, port = url.split("://", 1)[-1].rpartition(":")
        server = cls(None, _owned=False)
        server.host, server.port, server.api_key = host, int(port), api_key or env_api_key()
        try:
            resp = http().get(f"{url}/v1/models", headers=auth_headers(server.api_key),
                              timeout=timeout)
        except httpx.TransportError as err:
            raise ConnectionError(f"no vLLM server reachable at {url}: {err}") from err
        if resp.status_code != 200:
            raise ConnectionError(f"{url}/v1/models answered {resp.status_code}: {resp.text[:200]}")
        server.model_name = resp.json()["data"][0]["id"]
        return server

    def is_running(self) -> bool:
        if self.proc is None:
            return not self._owned and self.healthy()
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            resp = http().get(f"{self.url}/health", headers=auth_headers(self.api_key), timeout=2)
            return resp.status_code == 200
        except httpx.TransportError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        """The log's last ``lines``, with the API key replaced by ``***``."""
        if self.log_path is None or not self.log_path.is_file():
            return "(no log)"
        text = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return text.replace(self.api_key, "***") if self.api_key else text

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
            gpu = cuda_available()
            self.port = self.cfg.port or free_port(self.cfg.host)
            log_dir = Path(self.cfg.log_dir) if self.cfg.log_dir else runs_dir() / "vllm"
            log_dir.mkdir(parents=True, exist_ok=True)
            self.log_path = log_dir / f"server-{time.strftime('%Y%m%d-%H%M%S')}-{self.port}.log"
            cmd = self.cfg.command(self.port, gpu)
            cpus = None if self.cfg.cpus == "auto" else self.cfg.cpus
            self.cpus = plan(server_cpus=cpus, gpu=gpu).server_cpus
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
            self.watchdog = start_watchdog(self.proc.pid, self.server_id)

    def start(self, *, progress: bool = True) -> VLLMServer:
        """Spawn the server and wait for ``/health``; raises :class:`ServerStartError` (with the
        log's tail) when it exits, is stopped or times out first."""
        from tqdm.auto import tqdm

        try:
            self._spawn()
            t0 = time.perf_counter()
            with tqdm(total=None, desc=f"vLLM :{self.port}", disable=not progress,
                      bar_format="{desc} {elapsed} {postfix}", leave=False) as bar:
                while not self.healthy():
                    elapsed = time.perf_counter() - t0
                    if self._stopped:
                        raise ServerStartError(f"stopped while starting ({elapsed:.0f} s)")
                    if self.proc.poll() is not None:
                        raise ServerStartError(
                            f"vLLM exited with code {self.proc.returncode} after {elapsed:.0f} s; "
                            f"log {self.log_path}:\n{self.log_tail()}")
                    if elapsed > self.cfg.startup_timeout:
                        raise ServerStartError(
                            f"vLLM not healthy after {self.cfg.startup_timeout:.0f} s (ServerConfig"
                            f".startup_timeout); log {self.log_path}:\n{self.log_tail()}")
                    last = self.log_tail(5).strip().splitlines()
                    bar.set_postfix_str(last[-1][-120:] if last else "")
                    time.sleep(0.5)
            self.startup_seconds = round(time.perf_counter() - t0, 1)
        except BaseException:  # includes KeyboardInterrupt: never leave a half-started server
            self.stop()
            raise
        return self

    async def start_async(self, *, progress: bool = False) -> VLLMServer:
        """:meth:`start` for ``asyncio`` code; cancelling the awaiting task stops the server."""
        try:
            return await asyncio.to_thread(self.start, progress=progress)
        except asyncio.CancelledError:
            await asyncio.to_thread(self.stop)
            raise

    def pids(self) -> list[int]:
        """Every process of this server (found by the marker in their environment)."""
        return [p.pid for p in marked_processes([self.server_id])] if self._owned else []

    def stop(self, timeout: float = 20.0) -> None:
        """End the whole process tree: SIGTERM the group, wait, then SIGKILL what is left."""
        with self._lock:
            self._stopped = True
            if self._owned and self.proc is not None:
                end_processes(marked_processes([self.server_id]), self.proc.pid, timeout)
                # a child forked while the group was signalled got SIGTERM but no wait: wait now
                end_processes(marked_processes([self.server_id]), None, 5)
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

    def __repr__(self) -> str:
        state = "attached" if not self._owned else ("running" if self.is_running() else "stopped")
        return f"VLLMServer({self.model_name!r}, {self.url}, {state})"


@atexit.register
def stop_all() -> None:
    """Stop every server this process started and has not stopped (also runs at exit)."""
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(timeout=5)
