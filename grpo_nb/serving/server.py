"""Start, watch and stop a vLLM OpenAI-compatible server as a subprocess.

vLLM's server is a tree of processes (API server → EngineCore → worker). It is started in a
fresh process group, so that :meth:`VLLMServer.stop` ends the whole tree at once, whether the
notebook cell finished, raised, or was interrupted::

    ServerConfig ──► VLLMServer.start() ──spawn──► python -m vllm.entrypoints.openai.api_server
                          │    (own process group, log → runs/vllm/<name>.log)
                          ├── polls GET /health, shows elapsed time + the log's latest line
                          │       process died / timed out → ServerStartError(log tail)
                          ▼
                     .url / .base_url ──► client.CompletionsClient ──► /v1/completions
                          │
                     .stop() / with-block / atexit ──► SIGTERM group → wait → SIGKILL group

Safety: ``dev_mode`` turns on vLLM's ``/pause``, ``/update_weights``, ``/collective_rpc`` …
routes, which let anyone who reaches the port replace the weights. The server therefore binds
to loopback; any other host is refused unless ``api_key`` is set.

CPU and GPU run the same code: only the defaults differ (``VLLM_TARGET_DEVICE=cpu``, float32 and
a small KV cache on CPU; the checkpoint's dtype and a memory fraction on GPU).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_nb.config import cache_dir, runs_dir

MARKER_ENV = "GRPO_NB_SERVER_ID"  # every process of a server we start inherits this variable
STARTED_IDS: list[str] = []  # ids of every server this Python process started
_LIVE: weakref.WeakSet[VLLMServer] = weakref.WeakSet()


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (another process could still take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerConfig:
    """How to run ``vllm serve``. ``None`` fields take CPU or GPU defaults at start time.

    Args:
        model: a model folder (e.g. :func:`grpo_nb.tiny_model.build_or_load`) or a hub name.
        port: ``0`` picks a free port.
        dtype: ``"float32"`` on CPU (exact log-prob agreement with the trainer), ``"auto"`` on GPU.
        kv_cache_bytes: KV cache size; CPU default 64 MiB (plenty for the tiny model).
        gpu_memory_utilization: GPU only; leave room for the trainer on the same GPU.
        api_key: required for a non-loopback ``host``.
        log_dir: where ``<name>.log`` goes; default ``runs/vllm``.
        startup_timeout: seconds to wait for ``/health`` (first CPU start compiles for ~2 min).
        extra_args / env: appended to the command line / the server's environment.
        dev_mode: ``VLLM_SERVER_DEV_MODE=1`` (pause / weight-update routes; loopback only).
        worker_extension_cls / weight_transfer_config: for weight sync (notebook 05).
    """

    model: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str | None = None
    max_model_len: int = 512
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.5
    api_key: str | None = None
    served_model_name: str | None = None
    log_dir: Path | str | None = None
    startup_timeout: float = 600.0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    dev_mode: bool = True
    worker_extension_cls: str | None = None
    weight_transfer_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.model = str(self.model)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerConfig.port={self.port}: use 0 (pick a free port) .. 65535")
        if self.max_model_len < 8:
            raise ValueError(f"ServerConfig.max_model_len={self.max_model_len}: must be ≥ 8")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1 << 20:
            raise ValueError(f"ServerConfig.kv_cache_bytes={self.kv_cache_bytes}: need ≥ 1 MiB")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"ServerConfig.gpu_memory_utilization={self.gpu_memory_utilization}: use (0, 1]"
            )
        if self.startup_timeout <= 0:
            raise ValueError(f"ServerConfig.startup_timeout={self.startup_timeout}: must be > 0")
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(
                f"ServerConfig.host={self.host!r} is not loopback: set api_key, because the "
                "server's weight-update routes would be open to the network"
            )
        if not all(isinstance(a, str) for a in self.extra_args):
            raise ValueError(f"ServerConfig.extra_args={self.extra_args!r}: strings only")

    @classmethod
    def smoke(cls, model: str | Path = "") -> ServerConfig:
        """Small KV cache, short context: the tiny model on a 2-core CPU."""
        return cls(model=str(model), max_model_len=256, kv_cache_bytes=64 << 20)

    def command(self, port: int, gpu: bool) -> list[str]:
        """The server's command line (``port`` already resolved)."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model, "--host", self.host, "--port", str(port),
               "--dtype", self.dtype or ("auto" if gpu else "float32"),
               "--max-model-len", str(self.max_model_len),
               "--served-model-name", self.served_model_name or self.model,
               "--disable-uvicorn-access-log"]
        if gpu:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        kv = self.kv_cache_bytes if self.kv_cache_bytes is not None else (None if gpu else 64 << 20)
        if kv is not None:
            cmd += ["--kv-cache-memory-bytes", str(kv)]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.worker_extension_cls:
            cmd += ["--worker-extension-cls", self.worker_extension_cls]
        if self.weight_transfer_config is not None:
            cmd += ["--weight-transfer-config", json.dumps(self.weight_transfer_config)]
        return cmd + list(self.extra_args)

    def environment(self, server_id: str, gpu: bool) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would silently override kv_cache_bytes
        env.update({MARKER_ENV: server_id, "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
                    "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"})
        if not gpu:
            env["VLLM_TARGET_DEVICE"] = "cpu"
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.env)
        return env


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message ends with its log's tail."""


def log_tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.is_file():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _last_line(path: Path | None) -> str:
    tail = log_tail(path, 5).strip().splitlines()
    return tail[-1][-120:] if tail else ""


def _get(url: str, api_key: str | None, timeout: float = 2.0) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


class VLLMServer:
    """A vLLM server this process owns (``start``/``stop``), or one it attached to (``attach``).

    Use as a context manager (``with VLLMServer(cfg) as server:``) or call ``start()`` and
    ``stop()``; servers still running when Python exits are stopped by an ``atexit`` hook.
    """

    def __init__(self, cfg: ServerConfig) -> None:
        if not cfg.model:
            raise ValueError("ServerConfig.model is empty: pass a model folder or hub name")
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int = cfg.port
        self.host: str = cfg.host
        self.api_key = cfg.api_key
        self.model_name = cfg.served_model_name or cfg.model
        self.server_id = uuid.uuid4().hex[:12]
        self.log_path: Path | None = None
        self.startup_seconds: float | None = None
        self._owned = True

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

        ``stop()`` on an attached server does nothing: it is not ours to end.
        """
        url = url.rstrip("/").removesuffix("/v1")
        host_port = url.split("://", 1)[-1]
        host, _, port = host_port.rpartition(":")
        server = cls.__new__(cls)
        server.cfg, server.proc, server.api_key, server._owned = None, None, api_key, False
        server.host, server.port = host, int(port)
        server.server_id, server.log_path, server.startup_seconds = "", None, None
        try:
            status, _ = _get(f"{url}/health", api_key, timeout)
            if status != 200:
                raise ConnectionError(f"{url}/health answered {status}")
            status, body = _get(f"{url}/v1/models", api_key, timeout)
            if status != 200:
                raise ConnectionError(f"{url}/v1/models answered {status}: {body[:200]}")
        except (OSError, urllib.error.URLError) as err:
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
        except (OSError, urllib.error.URLError):
            return False

    def start(self, *, progress: bool = True) -> VLLMServer:
        """Spawn the server and wait for ``/health``; raises :class:`ServerStartError`."""
        if not self._owned:
            raise RuntimeError("an attached server cannot be started")
        if self.proc is not None:
            raise RuntimeError("server already started")
        gpu = _gpu_available()
        self.port = self.cfg.port or free_port(self.cfg.host)
        log_dir = Path(self.cfg.log_dir) if self.cfg.log_dir else runs_dir() / "vllm"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{time.strftime('%Y%m%d-%H%M%S')}-{self.port}.log"
        cmd = self.cfg.command(self.port, gpu)
        with self.log_path.open("wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.cfg.environment(self.server_id, gpu), start_new_session=True,
            )
        STARTED_IDS.append(self.server_id)
        _LIVE.add(self)
        try:
            self._wait_healthy(progress)
        except BaseException:  # includes KeyboardInterrupt: never leave a half-started server
            self.stop()
            raise
        return self

    def _wait_healthy(self, progress: bool) -> None:
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        bar = tqdm(total=None, desc=f"vLLM :{self.port}", disable=not progress,
                   bar_format="{desc} {elapsed} {postfix}", leave=False)
        try:
            while True:
                elapsed = time.perf_counter() - t0
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"vLLM exited with code {self.proc.returncode} after {elapsed:.0f} s; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}")
                if elapsed > self.cfg.startup_timeout:
                    raise ServerStartError(
                        f"vLLM not healthy after {self.cfg.startup_timeout:.0f} s "
                        f"(ServerConfig.startup_timeout); log {self.log_path}:\n"
                        f"{log_tail(self.log_path)}")
                if self.healthy():
                    self.startup_seconds = round(elapsed, 1)
                    return
                bar.set_postfix_str(_last_line(self.log_path), refresh=False)
                bar.update(0)
                time.sleep(0.5)
        finally:
            bar.close()

    def pids(self) -> list[int]:
        """Every process of this server (found by the marker in their environment)."""
        return [p.pid for p in find_server_processes([self.server_id])]

    def stop(self, timeout: float = 20.0) -> None:
        """End the whole process tree: SIGTERM the group, wait, then SIGKILL what is left."""
        if not self._owned or self.proc is None:
            return
        import psutil

        stragglers = find_server_processes([self.server_id])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        for p in stragglers:  # children that left the group (none expected) get it too
            with contextlib.suppress(psutil.Error):
                p.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        _, alive = psutil.wait_procs(stragglers, timeout=max(1.0, timeout / 4))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in alive + find_server_processes([self.server_id]):
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        _LIVE.discard(self)

    def __enter__(self) -> VLLMServer:
        if self._owned and self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "attached" if not self._owned else ("running" if self.is_running() else "stopped")
        return f"VLLMServer({self.model_name!r}, {self.url}, {state})"


def find_server_processes(server_ids: list[str] | None = None) -> list[Any]:
    """Processes carrying the marker of one of ``server_ids`` (default: all this process
    started). Used by ``stop()`` and by the tests' "no vLLM left behind" check."""
    import psutil

    ids = set(STARTED_IDS if server_ids is None else server_ids)
    found = []
    if not ids:
        return found
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if p.environ().get(MARKER_ENV) in ids and p.pid != os.getpid():
                found.append(p)
    return found


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(timeout=5)
