"""``ServerConfig``: how a vLLM server is run and who may reach it (``--api-key`` guards only
``/v1``, so a dev-mode server binds loopback only; a key travels in the environment, not argv)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_nb.config import cache_dir, env_flag
from grpo_nb.partition import check_spec, server_env
from grpo_nb.serving.net import env_api_key, is_loopback
from grpo_nb.serving.processes import MARKER_ENV, OWNER_ENV

INSECURE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"  # unpickles request data: loopback only
EAGER_ENV = "GRPO_NB_SERVER_EAGER"  # "1": every server starts eager (the test suite sets it)


@dataclass
class ServerConfig:
    """How to run ``vllm serve``; ``None`` fields take CPU or GPU defaults at start time."""

    model: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str | None = None
    max_model_len: int = 512
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.5
    api_key: str | None = field(default_factory=env_api_key, repr=False)
    name: str | None = None  # a starting server replaces a running one of the same name
    served_model_name: str | None = None
    log_dir: Path | str | None = None
    startup_timeout: float = 600.0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    dev_mode: bool = True
    worker_extension_cls: str | None = None
    weight_transfer_config: dict[str, Any] | None = None
    cpus: str | list[int] = "auto"  # pins the server tree: "auto", "off" or core ids
    # skip torch.compile: a sooner start, slower generation (pays for short-lived servers)
    eager: bool = field(default_factory=lambda: env_flag(EAGER_ENV))

    def __post_init__(self) -> None:
        self.model = str(self.model)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field (run again at start: fields may change)."""
        for name, ok, rule in (
                ("port", 0 <= self.port <= 65535, "0 (pick a free port) .. 65535"),
                ("max_model_len", self.max_model_len >= 8, "≥ 8"),
                ("kv_cache_bytes", (self.kv_cache_bytes or 1 << 20) >= 1 << 20, "≥ 1 MiB"),
                ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "(0, 1]"),
                ("startup_timeout", self.startup_timeout > 0, "> 0"),
                ("extra_args", all(isinstance(a, str) for a in self.extra_args), "strings")):
            if not ok:
                raise ValueError(f"ServerConfig.{name}={getattr(self, name)!r}: use {rule}")
        for flag, name in (("--host", "host"), ("--api-key", "api_key"),
                           ("--enforce-eager", "eager")):
            if any(a.split("=")[0] == flag for a in self.extra_args):
                raise ValueError(f"ServerConfig.extra_args has {flag}: set ServerConfig.{name}"
                                 " instead (it is checked there)")
        check_spec(self.cpus, "ServerConfig.cpus")
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
               "--served-model-name", self.served_model_name or self.model,
               "--disable-uvicorn-access-log",
               # log-probs of the distribution that was sampled (after temperature / top-p)
               "--logprobs-mode", "processed_logprobs",
               # vLLM's neutral defaults, not the folder's generation_config.json, for any
               # sampling field a request leaves unset (our clients set every one anyway)
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
