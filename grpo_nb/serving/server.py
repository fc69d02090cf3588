"""``ServerConfig`` (how vLLM runs, who may reach it: a key travels in the environment, not argv)
and ``VLLMServer``: start, watch and stop it as a process tree in its own group; a registry keeps
every server until stopped, so re-running a cell never orphans one."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

# httpx and psutil (grpo_nb.serving.processes) are imported where a server is reached or
# started: ServerConfig alone (placement, the GPU probe) needs neither
from grpo_nb.config import Fraction, Ge, Le, PosFloat, cache_dir, check_fields, env_flag, runs_dir
from grpo_nb.partition import cuda_available, format_cpus, parse_cpus, plan
from grpo_nb.serving.net import auth_headers, env_api_key, free_port, http, is_loopback

INSECURE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"  # unpickles request data: loopback only
EAGER_ENV = "GRPO_NB_SERVER_EAGER"  # "1": every server starts eager (the test suite sets it)
# What vLLM logs when its HTTP port is bound already. free_port() releases the port it found, so
# another process can take it before vLLM binds it (seconds later, on a loaded machine).
PORT_TAKEN = "Address already in use"
PORT_STARTS = 3  # starts on fresh ports before a picked port's collision counts as a failure
PLAIN_TICK_S = 30.0  # seconds between start-progress lines when stderr is a file or a pipe


@dataclass
class ServerConfig:
    """How to run ``vllm serve``; ``None`` fields take CPU or GPU defaults at start time."""

    model: str = ""  # a model folder or hub id (required at start)
    host: str = "127.0.0.1"  # the address served on (not loopback: api_key, no dev_mode)
    port: Annotated[int, Ge(0), Le(65535)] = 0  # 0: a free port picked at start
    dtype: str | None = None  # vLLM's --dtype; None: float32 on the CPU, auto on a GPU
    device: Literal["auto", "cpu", "cuda"] = "auto"  # "auto": CUDA where torch sees it
    max_model_len: Annotated[int, Ge(8)] = 512  # the longest prompt + completion served
    kv_cache_bytes: Annotated[int, Ge(1 << 20)] | None = None  # None: vLLM's default
    gpu_memory_utilization: Fraction = 0.5  # vLLM's share of the GPU's memory
    api_key: str | None = field(default_factory=env_api_key, repr=False)  # guards /v1 routes
    name: str | None = None  # a starting server replaces a running one of the same name
    log_dir: Path | str | None = None  # where its log goes; None: runs/vllm/
    startup_timeout: PosFloat = 600.0  # seconds until it must answer /health
    extra_args: list[str] = field(default_factory=list)  # more `vllm serve` flags
    env: dict[str, str] = field(default_factory=dict)  # more environment for the server
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE: /pause, /update_weights, /collective_rpc
    worker_extension_cls: str | None = None  # vLLM's --worker-extension-cls
    weight_transfer_config: dict[str, Any] | None = None  # vLLM's --weight-transfer-config
    cpus: str | list[int] = "auto"  # pins the server tree: "auto", "off" or core ids
    # skip torch.compile: a sooner start, slower generation (pays for short-lived servers)
    eager: bool = field(default_factory=lambda: env_flag(EAGER_ENV))

    def __post_init__(self) -> None:
        self.model = str(self.model)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field (run again at start: fields may change)."""
        check_fields(self)
        for flag, name in (("--host", "host"), ("--api-key", "api_key"),
                           ("--enforce-eager", "eager")):
            if any(a.split("=")[0] == flag for a in self.extra_args):
                raise ValueError(f"ServerConfig.extra_args has {flag}: set ServerConfig.{name}"
                                 " instead (it is checked there)")
        if self.cpus not in (None, "auto", "off"):
            parse_cpus(self.cpus, "ServerConfig.cpus")
        if "VLLM_API_KEY" in self.env:
            raise ValueError("ServerConfig.env has VLLM_API_KEY: set ServerConfig.api_key")
        if is_loopback(self.host):
            return
        if self.dev_mode:
            raise ValueError(
                f"ServerConfig.host={self.host!r} is not loopback, but dev_mode=True turns on "
                "/pause, /update_weights, /collective_rpc …: vLLM's api_key guards only /v1 "
                "routes, so anyone reaching the port could replace the weights. A dev-mode "
                "server binds loopback only, key or not")
        if not self.api_key:
            raise ValueError(f"ServerConfig.host={self.host!r} is not loopback: set api_key")
        if self.env.get(INSECURE_ENV, "0") not in ("", "0"):
            raise ValueError(f"ServerConfig.env[{INSECURE_ENV!r}] lets the server unpickle "
                             f"request data: allowed on loopback only, not host={self.host!r}")

    def on_gpu(self) -> bool:
        """Whether the server runs on CUDA (``device``; "auto": where torch sees it)."""
        return self.device == "cuda" or (self.device == "auto" and cuda_available())

    @classmethod
    def smoke(cls, model: str | Path = "") -> ServerConfig:
        """Small KV cache, short context: the tiny model on a 2-core CPU (notebook 04)."""
        return cls(model=str(model), max_model_len=256, kv_cache_bytes=64 << 20)

    def command(self, port: int, gpu: bool) -> list[str]:
        """The server's command line (``port`` already resolved; never holds the key)."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model, "--host", self.host, "--port", str(port),
               "--dtype", self.dtype or ("auto" if gpu else "float32"),
               "--max-model-len", str(self.max_model_len),
               "--disable-uvicorn-access-log",
               # log-probs of the distribution that was sampled (after temperature / top-p)
               "--logprobs-mode", "processed_logprobs",
               # vLLM's neutral defaults, not the folder's generation_config.json, for any
               # sampling field a request leaves unset (our clients set every one anyway)
               "--generation-config", "vllm",
               # routes /inference/v1/generate (the sampler's: per-token weight versions) and
               # vLLM's render / derender, all under the API key's prefixes; the server builds
               # their handlers with or without it, the flag only adds the routes
               "--enable-scale-out"]
        if gpu:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        kv = self.kv_cache_bytes if self.kv_cache_bytes is not None else (None if gpu else 64 << 20)
        if kv is not None:
            cmd += ["--kv-cache-memory-bytes", str(kv)]
        if self.eager:
            cmd += ["--enforce-eager"]
        if self.worker_extension_cls:
            cmd += ["--worker-extension-cls", self.worker_extension_cls]
        if self.weight_transfer_config is not None:
            cmd += ["--weight-transfer-config", json.dumps(self.weight_transfer_config)]
        return cmd + list(self.extra_args)

    def environment(self, server_id: str, gpu: bool,
                    cpus: tuple[int, ...] | None = None) -> dict[str, str]:
        from grpo_nb.serving import processes

        env = dict(os.environ)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would silently override kv_cache_bytes
        env.pop("VLLM_API_KEY", None)  # the server's key is ours to set, not inherited
        env.update({processes.MARKER_ENV: server_id, processes.OWNER_ENV: str(os.getpid()),
                    "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
                    "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"})
        if not gpu:
            env["VLLM_TARGET_DEVICE"] = "cpu"
            if cpus:  # vLLM-CPU's OpenMP threads on exactly these cores (else it picks its own)
                env.update({"VLLM_CPU_OMP_THREADS_BIND": format_cpus(cpus),
                            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
        elif (self.dtype or "auto") == "float32":  # fp32 on CUDA: attention in IEEE fp32
            # FlashAttention takes no fp32, so vLLM runs Triton's unified attention, whose
            # tl.dot calls name no input_precision: Triton then uses TRITON_F32_DEFAULT, and
            # without it TF32 (triton/language/core.py). VLLM_FLOAT32_MATMUL_PRECISION
            # ("highest" by default) covers the cuBLAS matmuls only.
            env["TRITON_F32_DEFAULT"] = "ieee"
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        from grpo_nb.weight_sync.vllm_compat import SERVER_ENV  # a server needs vLLM: the gate

        env.update(SERVER_ENV)
        env.update(self.env)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env


_LIVE: set[VLLMServer] = set()  # strong: a dropped variable must not orphan a running server


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
        self.model_name = cfg.model if cfg else ""
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
        import httpx

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
        """``/health`` answers 200 and, for a server this process started, it is this server
        that answers (not another that took the port first)."""
        import httpx

        try:
            resp = http().get(f"{self.url}/health", headers=auth_headers(self.api_key), timeout=2)
        except httpx.TransportError:
            return False
        from grpo_nb.serving.processes import listening_on

        return resp.status_code == 200 and (not self._owned or listening_on(self.server_id,
                                                                            self.port))

    def log_tail(self, lines: int = 30) -> str:
        """The log's last ``lines``, with the API key replaced by ``***``."""
        if self.log_path is None or not self.log_path.is_file():
            return "(no log)"
        text = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return text.replace(self.api_key, "***") if self.api_key else text

    def _spawn(self) -> None:
        """Validate, register, spawn the server and its watchdog (fast; no waiting)."""
        from grpo_nb.serving import processes

        with self._lock:
            if not self._owned:
                raise RuntimeError("an attached server cannot be started")
            if self._stopped or self.proc is not None:
                raise RuntimeError("server already started or stopped: create a new VLLMServer")
            self.cfg.validate()  # fields may have been set after construction
            self.api_key = self.cfg.api_key
            for old in [s for s in _LIVE if self.cfg.name and s.cfg.name == self.cfg.name
                        and s is not self]:
                print(f"stopping the previous server named {self.cfg.name!r} ({old.url})")
                old.stop()
            gpu = self.cfg.on_gpu()
            self.port = self.cfg.port or free_port(self.cfg.host)
            log_dir = Path(self.cfg.log_dir) if self.cfg.log_dir else runs_dir() / "vllm"
            log_dir.mkdir(parents=True, exist_ok=True)
            self.log_path = log_dir / f"server-{time.strftime('%Y%m%d-%H%M%S')}-{self.port}.log"
            cmd = self.cfg.command(self.port, gpu)
            cpus = None if self.cfg.cpus == "auto" else self.cfg.cpus
            self.cpus = plan(server_cpus=cpus, gpu=gpu).server_cpus
            _LIVE.add(self)
            mask = os.sched_getaffinity(0)
            with self.log_path.open("wb") as log:
                log.write(("$ " + " ".join(cmd) + "\n").encode())
                log.flush()
                # this thread's mask: the child, and every process and thread it starts, inherit it
                os.sched_setaffinity(0, self.cpus or mask)
                try:
                    self.proc = subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        env=self.cfg.environment(self.server_id, gpu, self.cpus),
                        start_new_session=True)
                finally:
                    os.sched_setaffinity(0, mask)
            self.watchdog = processes.start_watchdog(self.proc.pid, self.server_id)

    def start(self, *, progress: bool = True) -> VLLMServer:
        """Spawn the server and wait for ``/health``; raises :class:`ServerStartError` (with the
        log's tail) when it exits, is stopped or times out first."""
        from tqdm.auto import tqdm

        try:
            self._spawn()
            starts = 1
            t0 = time.perf_counter()
            with tqdm(total=None, desc=f"vLLM :{self.port}", disable=not progress,
                      bar_format="{desc} {elapsed} {postfix}", leave=False) as bar:
                # a terminal or a notebook redraws one line; a log file or pipe gets a line a tick
                live = sys.stderr.isatty() or any(c.__module__ == "tqdm.notebook"
                                                  for c in type(bar).__mro__)  # tqdm.auto's
                every, shown = (0.5 if live else PLAIN_TICK_S), 0.0
                while not self.healthy():
                    elapsed = time.perf_counter() - t0
                    if self._stopped:
                        raise ServerStartError(f"stopped while starting ({elapsed:.0f} s)")
                    if self.proc.poll() is not None:
                        taken = PORT_TAKEN in self.log_path.read_text(errors="replace")
                        if taken and not self.cfg.port and starts < PORT_STARTS:
                            bar.write(f"port {self.port} was taken before vLLM bound it: "
                                      "starting again on another")
                            with self._lock:  # what is left of this start, then a fresh port
                                self._end_tree(timeout=5)
                                self.proc = self.watchdog = None
                            self._spawn()
                            bar.set_description_str(f"vLLM :{self.port}")
                            starts += 1
                            continue
                        hint = (f" (port {self.port} is in use: ServerConfig.port=0 picks a free "
                                "one)" if taken and self.cfg.port else "")
                        raise ServerStartError(
                            f"vLLM exited with code {self.proc.returncode} after {elapsed:.0f} s"
                            f"{hint}; log {self.log_path}:\n{self.log_tail()}")
                    if elapsed > self.cfg.startup_timeout:
                        raise ServerStartError(
                            f"vLLM not healthy after {self.cfg.startup_timeout:.0f} s (ServerConfig"
                            f".startup_timeout); log {self.log_path}:\n{self.log_tail()}")
                    if time.perf_counter() - shown >= every:
                        bar.set_postfix_str(self.log_tail(1)[-120:])
                        shown = time.perf_counter()
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
        from grpo_nb.serving import processes

        return [p.pid for p in processes.marked_processes([self.server_id])] if self._owned else []

    def stop(self, timeout: float = 20.0) -> None:
        """End the whole process tree: SIGTERM the group, wait, then SIGKILL what is left."""
        with self._lock:
            self._stopped = True
            self._end_tree(timeout)
            _LIVE.discard(self)

    def _end_tree(self, timeout: float) -> None:
        """End the server's processes and its watchdog (the caller holds the lock)."""
        from grpo_nb.serving import processes

        if self._owned and self.proc is not None:
            processes.end_processes(processes.marked_processes([self.server_id]),
                                    self.proc.pid, timeout)
            # a child forked while the group was signalled got SIGTERM but no wait: wait now
            processes.end_processes(processes.marked_processes([self.server_id]), None, 5)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        if self.watchdog is not None:
            self.watchdog.kill()
            self.watchdog.wait()

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
