"""Where the LLM ring runs and what it serves, derived from the config: device and dtype, the
weight-sync transport and tolerance, the vLLM server's size; checks name the ``LLMConfig`` field."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from grpo_nb.llm import cost
from grpo_nb.partition import cuda_available
from grpo_nb.weight_sync import WeightSyncConfig

DTYPE_ATOL = {"float32": 1e-3, "bfloat16": 0.15}  # probe log-prob gap trainer vs server
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
CPU_KV_MIN, CPU_KV_MAX = 64 << 20, 4 << 30
OWN_GPU_FRACTION = 0.85  # the server's share of a GPU the trainer does not use
SHARED_GPU_FALLBACK = 0.35  # its share of a shared GPU when the model's shape is unknown


def check_model(model: Any) -> None:
    """``LLMConfig.model``: None (the tiny model), a folder with a config.json, or a hub id."""
    if model is not None:
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"LLMConfig.model={model!r}: give a model folder or a hub id")
        if Path(model).expanduser().exists():
            if not (Path(model).expanduser() / "config.json").is_file():
                raise ValueError(f"LLMConfig.model={model!r}: the folder has no config.json "
                                 "(save it with save_pretrained)")
        elif model.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(model):
            raise ValueError(f"LLMConfig.model={model!r}: no such folder, and not a hub id "
                             "('owner/name', e.g. 'Qwen/Qwen3-0.6B')")


def check_placement(cfg: Any) -> None:
    """The device and transport fields of ``cfg`` against the devices here (resolve's check)."""
    if cfg.device == "cuda" and not cuda_available():
        raise ValueError("LLMConfig.device='cuda': no CUDA device here (use 'auto' or 'cpu')")
    if device_of(cfg) == "cpu" and cfg.sync.transport in ("nccl", "ipc"):
        raise ValueError(f"LLMConfig.sync.transport={cfg.sync.transport!r} needs CUDA, but "
                         "the trainer runs on the CPU: use 'gloo' or 'reload'")
    if device_of(cfg) != "cuda":
        return
    # The server takes the first GPU and the trainer the last, so one GPU holds both and two or
    # more keep them apart: refuse a CUDA transport this placement cannot carry.
    transport, gpus = cfg.sync.transport, gpu_count()
    unset = "or leave sync.transport at 'gloo', which picks the transport by GPU count"
    if transport == "nccl" and gpus < 2:
        raise ValueError(
            f"LLMConfig.sync.transport='nccl' needs two GPUs, but {gpus} is visible: with one "
            "GPU the server and the trainer share it, and NCCL refuses two ranks on one device "
            f"('Duplicate GPU detected'). Use sync.transport='ipc' ({unset})")
    if transport == "ipc" and gpus >= 2:
        raise ValueError(
            f"LLMConfig.sync.transport='ipc' needs the server on the trainer's GPU, but with "
            f"{gpus} GPUs the server runs on the first and the trainer on the last (vLLM's IPC "
            "engine finds no handle for the server's GPU). Use sync.transport='nccl' "
            f"({unset}), or make one GPU visible (CUDA_VISIBLE_DEVICES)")


def ring_sync(given: dict[str, Any], cfg: Any) -> tuple[WeightSyncConfig, str | None]:
    """``LLMConfig.sync`` from the fields ``given``; a ``pause_mode`` left out is the ring's
    for the transport and device, returned with why (for ``cfg.defaults``)."""
    if "pause_mode" in given:
        return WeightSyncConfig(**given), None
    transport, device = given.get("transport", "gloo"), device_of(cfg)
    if device == "cpu" and transport in ("gloo", "reload"):
        pause, why = "none", f"vLLM's CPU engine runs a {transport} update between two steps"
    else:  # on a GPU engine a step may run while an update lands: freeze the requests
        pause, why = "keep", f"transport {transport!r} on {device}: 'none' is only sure on " \
                             "vLLM's CPU engine"
    return WeightSyncConfig(**given, pause_mode=pause), f"{pause} ({why})"


def device_of(cfg: Any) -> str:
    return cfg.device if cfg.device != "auto" else "cuda" if cuda_available() else "cpu"


def dtype_of(cfg: Any) -> str:
    if cfg.dtype == "auto":
        return "bfloat16" if device_of(cfg) == "cuda" else "float32"
    return cfg.dtype


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if cuda_available() else 0


def trainer_device(cfg: Any) -> str:
    """The trainer's torch device: with 2+ GPUs the last one (the server takes the first)."""
    if device_of(cfg) == "cpu":
        return "cpu"
    return f"cuda:{gpu_count() - 1}" if gpu_count() >= 2 else "cuda:0"


def sync_of(cfg: Any) -> WeightSyncConfig:
    """``cfg.sync`` with the transport and tolerance this device and dtype need."""
    transport, pause = cfg.sync.transport, cfg.sync.pause_mode
    if device_of(cfg) == "cuda" and transport == "gloo":
        transport = "nccl" if gpu_count() >= 2 else "ipc"
        pause = "keep" if pause == "none" else pause  # "none" is only sure on vLLM's CPU engine
    return replace(cfg.sync, transport=transport, pause_mode=pause,
                   atol=max(cfg.sync.atol, DTYPE_ATOL[dtype_of(cfg)]))


def model_shape(model: str) -> cost.ModelShape | None:
    """The model's shape from its folder's ``config.json``, a hub id's cached one (no
    network), or :data:`cost.QWEN3` by name; None when none of them knows it."""
    path = Path(model) / "config.json"
    if not path.is_file() and _HUB_ID.fullmatch(model):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
        path = Path(cached) if isinstance(cached, str) else path
    if path.is_file():
        return cost.ModelShape.from_hf(json.loads(path.read_text()))
    return cost.QWEN3.get(model.rsplit("/", 1)[-1])


def gpu_total_bytes() -> int:
    """The first visible GPU's memory (the one the server runs on)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def _server_terms(shape: cost.ModelShape, cfg: Any) -> dict[str, int]:
    """:func:`cost.server_terms` for the ring's requests in flight at full context."""
    return cost.server_terms(shape, cfg.generators * cfg.max_inflight, cfg.context_len,
                             dtype_of(cfg))


def shared_gpu_fraction(shape: cost.ModelShape | None, cfg: Any) -> float:
    """The server's ``gpu_memory_utilization`` when it shares the one GPU with the trainer: its
    need (:func:`_server_terms`) over the card, rounded up to 0.01; ``SHARED_GPU_FALLBACK`` for
    a model whose shape is unknown here."""
    if shape is None:
        return SHARED_GPU_FALLBACK
    need = sum(_server_terms(shape, cfg).values())
    return min(cost.server_fraction(need, gpu_total_bytes()), OWN_GPU_FRACTION)


def server_config(model_dir: str, cfg: Any) -> Any:
    """The :class:`~grpo_nb.serving.server.ServerConfig` this run needs (not started)."""
    from grpo_nb.serving.server import ServerConfig

    cfg = cfg.resolve()  # max_tokens and the sync's pause mode (a resolved config: as it is)
    device, shape = device_of(cfg), model_shape(str(model_dir))
    scfg = ServerConfig(model=str(model_dir), max_model_len=cfg.context_len, dtype=dtype_of(cfg),
                        device=device)
    if cfg.kv_cache_mb is not None:
        scfg.kv_cache_bytes = cfg.kv_cache_mb << 20
    elif device == "cpu":  # every sequence in flight (+ eval and probes) at full context, bounded
        want = CPU_KV_MIN if shape is None else _server_terms(shape, cfg)["kv_cache"]
        scfg.kv_cache_bytes = min(max(want, CPU_KV_MIN), CPU_KV_MAX)
    if device != "cpu":
        own_gpu = gpu_count() >= 2
        scfg.gpu_memory_utilization = cfg.gpu_memory_utilization or (
            OWN_GPU_FRACTION if own_gpu else shared_gpu_fraction(shape, cfg))
        if own_gpu:  # the trainer takes the last GPU, the server the first this process sees
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            scfg.env = {**scfg.env, "CUDA_VISIBLE_DEVICES": first or "0"}
    for key, value in sync_of(cfg).server_settings().items():
        setattr(scfg, key, {**scfg.env, **value} if key == "env" else value)
    scfg.validate()
    return scfg
