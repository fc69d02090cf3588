"""``ServerConfig``: how a vLLM server is run, and who may reach it.

Validation happens at construction and again at start (fields are plain attributes that
callers such as ``WeightSyncConfig.server_settings`` set afterwards). The rules, and why:

- ``dev_mode`` (``VLLM_SERVER_DEV_MODE=1``) adds routes that change the served model. vLLM's
  ``--api-key`` guards only ``/v1``-style paths, never these, so a dev-mode server binds
  loopback only, key or not.
- Any other host needs ``api_key``; the key travels in the server's environment
  (``VLLM_API_KEY``), never in argv where ``ps`` shows it to every user.
- ``VLLM_ALLOW_INSECURE_SERIALIZATION`` (pickled request data, for CUDA-IPC handles) only where
  nobody else can reach the server: loopback.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_nb.config import cache_dir, env_flag
from grpo_nb.partition import check_spec, parse_cpus, plan, server_env
from grpo_nb.serving.net import is_loopback
from grpo_nb.serving.processes import MARKER_ENV, OWNER_ENV

DEV_ROUTES = "/pause, /update_weights, /init_weight_transfer_engine, /collective_rpc"
INSECURE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


EAGER_ENV = "GRPO_NB_SERVER_EAGER"  # "1": every server starts eager (the test suite sets it)


def env_api_key() -> str | None:
    return os.environ.get("VLLM_API_KEY") or None


@dataclass
class ServerConfig:
    """How to run ``vllm serve``. ``None`` fields take CPU or GPU defaults at start time.

    Args:
        model: a model folder (e.g. :func:`grpo_nb.tiny_model.build_or_load`) or a hub name.
        host: loopback only when ``dev_mode`` (see the module docstring); otherwise a
            non-loopback host needs ``api_key``.
        port: ``0`` picks a free port.
        dtype: ``"float32"`` on CPU (exact log-prob agreement with the trainer), ``"auto"`` on GPU.
        kv_cache_bytes: KV cache size; CPU default 64 MiB (plenty for the tiny model).
        gpu_memory_utilization: GPU only; leave room for the trainer on the same GPU.
        api_key: required on ``/v1`` routes; default ``$VLLM_API_KEY``. Passed to the server
            by environment, never on its command line; not shown in ``repr``.
        name: starting a server with the name of a running one (in this process) stops the
            old one first: re-running a notebook cell replaces its server.
        log_dir: where ``<name>.log`` goes; default ``runs/vllm``.
        startup_timeout: seconds to wait for ``/health`` (first CPU start compiles for ~2 min).
        extra_args / env: appended to the command line / the server's environment.
        dev_mode: ``VLLM_SERVER_DEV_MODE=1`` (pause / weight-update routes; loopback only).
        worker_extension_cls / weight_transfer_config: for weight sync (notebook 05).
        cpus: the cores of the whole server tree (see :mod:`grpo_nb.partition`): ``"auto"``
            (the plan's: on a CPU-only machine with ≥ 2 cores the last core, else unpinned),
            ``"off"``, or core ids (``[1]``, ``"2-3"``). Resolved at start.
        eager: ``--enforce-eager`` (no ``torch.compile``, no CUDA graphs). Off by default:
            eager starts sooner but generates fewer tokens/s
            (``python benchmarks/server_compile.py`` measures both), so it pays only for short
            runs. Default ``$GRPO_NB_SERVER_EAGER=1`` (``make test`` sets it: its servers live
            seconds).
    """

    model: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str | None = None
    max_model_len: int = 512
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.5
    api_key: str | None = field(default_factory=env_api_key, repr=False)
    name: str | None = None
    served_model_name: str | None = None
    log_dir: Path | str | None = None
    startup_timeout: float = 600.0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    dev_mode: bool = True
    worker_extension_cls: str | None = None
    weight_transfer_config: dict[str, Any] | None = None
    cpus: str | list[int] = "auto"
    eager: bool = field(default_factory=lambda: env_flag(EAGER_ENV))

    def __post_init__(self) -> None:
        self.model = str(self.model)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field; run again at start (fields are mutable)."""
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
        if not all(isinstance(a, str) for a in self.extra_args):
            raise ValueError(f"ServerConfig.extra_args={self.extra_args!r}: strings only")
        for flag, name in (("--host", "host"), ("--api-key", "api_key"),
                           ("--enforce-eager", "eager")):
            if any(a.split("=")[0] == flag for a in self.extra_args):
                raise ValueError(f"ServerConfig.extra_args has {flag}: set ServerConfig.{name}"
                                 " instead (it is checked there)")
        check_spec(self.cpus, "ServerConfig.cpus")
        if "VLLM_API_KEY" in self.env:
            raise ValueError("ServerConfig.env has VLLM_API_KEY: set ServerConfig.api_key")
        self._check_exposure()

    def _check_exposure(self) -> None:
        if is_loopback(self.host):
            return
        if self.dev_mode:
            raise ValueError(
                f"ServerConfig.host={self.host!r} is not loopback, but dev_mode=True turns on "
                f"{DEV_ROUTES}: vLLM's api_key guards only /v1 routes, so anyone reaching the "
                "port could replace the weights or run any worker method. A dev-mode server "
                "binds loopback only, key or not (another host needs an authenticating proxy)")
        if not self.api_key:
            raise ValueError(f"ServerConfig.host={self.host!r} is not loopback: set api_key")
        if self.env.get(INSECURE_ENV, "0") not in ("", "0"):
            raise ValueError(f"ServerConfig.env[{INSECURE_ENV!r}] lets the server unpickle "
                             f"request data: allowed on loopback only, not host={self.host!r}")

    @classmethod
    def smoke(cls, model: str | Path = "") -> ServerConfig:
        """Small KV cache, short context: the tiny model on a 2-core CPU."""
        return cls(model=str(model), max_model_len=256, kv_cache_bytes=64 << 20)

    def command(self, port: int, gpu: bool) -> list[str]:
        """The server's command line (``port`` already resolved; never holds the key)."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model, "--host", self.host, "--port", str(port),
               "--dtype", self.dtype or ("auto" if gpu else "float32"),
               "--max-model-len", str(self.max_model_len),
               "--served-model-name", self.served_model_name or self.model,
               "--disable-uvicorn-access-log",
               # Log-probs *after* temperature/top-p (vLLM's default is before): those of the
               # distribution that was sampled, which is what a PPO ratio divides by.
               "--logprobs-mode", "processed_logprobs",
               # vLLM's neutral sampling defaults, not the model folder's generation_config.json
               # (Qwen3's: top_k 20, top_p 0.95, temperature 0.6) for any field a request
               # leaves unset; our clients set every one anyway (client.sampling_fields).
               "--generation-config", "vllm"]
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

    def resolve_cpus(self, gpu: bool) -> tuple[int, ...] | None:
        """The cores to pin the server tree to, or ``None`` (unpinned)."""
        if self.cpus == "off":
            return None
        if self.cpus == "auto":
            return plan(gpu=gpu).server_cpus
        cpus = parse_cpus(self.cpus, "ServerConfig.cpus") if isinstance(self.cpus, str) \
            else tuple(self.cpus)
        plan(cpus=None, server_cpus=cpus, gpu=gpu)  # raises if not ours or leaves no core
        return cpus

    def environment(self, server_id: str, gpu: bool,
                    cpus: tuple[int, ...] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would silently override kv_cache_bytes
        env.pop("VLLM_API_KEY", None)  # the server's key is ours to set, not inherited
        env.update({MARKER_ENV: server_id, OWNER_ENV: str(os.getpid()),
                    "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
                    "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"})
        if not gpu:
            env["VLLM_TARGET_DEVICE"] = "cpu"
            if cpus:
                env.update(server_env(cpus))
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.env)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env
