"""What the GPU placement cannot carry is refused when the config is made, naming the setting
and the fix; what it can carry works from the command line; the server runs on the device
the config names. CUDA is faked (``placement``'s probes and ``torch.cuda.is_available``, as
in test_gpu_path.py); no GPU, no server.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_nb.llm import placement
from grpo_nb.llm.cli import parse_config
from grpo_nb.llm.config import LLMConfig


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    monkeypatch.setattr(placement, "cuda_available", lambda: gpus > 0)
    monkeypatch.setattr(placement, "gpu_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)


def test_nccl_on_one_gpu_is_refused_naming_the_setting_and_the_fix(monkeypatch, capsys) -> None:
    """One GPU holds the server and the trainer: NCCL refuses two ranks on one device, so
    ``nccl`` is refused (in the config and on the command line) and ``ipc`` offered."""
    _fake_gpus(monkeypatch, 1)
    why = (r"LLMConfig\.sync\.transport='nccl' needs two GPUs, but 1 is visible.*"
           r"Duplicate GPU detected.*Use sync\.transport='ipc'")
    with pytest.raises(ValueError, match=why):
        LLMConfig(sync={"transport": "nccl"})
    with pytest.raises(ValueError, match=why):
        LLMConfig().replace(sync={"transport": "nccl", "pause_mode": "keep"})
    with pytest.raises(SystemExit):
        parse_config(["--transport", "nccl"])
    assert re.search(why, capsys.readouterr().err.replace("\n", " "))


def test_ipc_across_gpus_is_refused_naming_the_setting_and_the_fix(monkeypatch, capsys) -> None:
    """With two GPUs the server runs on the first and the trainer on the last: vLLM's IPC
    engine finds no handle for the server's GPU, so ``ipc`` is refused and ``nccl`` offered."""
    _fake_gpus(monkeypatch, 2)
    why = (r"LLMConfig\.sync\.transport='ipc' needs the server on the trainer's GPU, but with "
           r"2 GPUs.*Use sync\.transport='nccl'.*CUDA_VISIBLE_DEVICES")
    with pytest.raises(ValueError, match=why):
        LLMConfig(sync={"transport": "ipc"})
    with pytest.raises(SystemExit):
        parse_config(["--transport", "ipc"])
    assert re.search(why, capsys.readouterr().err.replace("\n", " "))


@pytest.mark.parametrize(("gpus", "transport"), [(1, "ipc"), (2, "nccl")])
def test_cli_transport_takes_a_pause_mode_the_transport_can_use(monkeypatch, gpus,
                                                                transport) -> None:
    """``--transport ipc|nccl``: the ring's default pause mode ("none", for vLLM's CPU engine)
    becomes "keep", said in ``cfg.defaults`` and kept by ``replace``; the server is started
    with that engine and the syncer gets the same transport."""
    _fake_gpus(monkeypatch, gpus)
    _, cfg, _ = parse_config(["--transport", transport])
    assert (cfg.sync.transport, cfg.sync.pause_mode) == (transport, "keep")
    assert cfg.defaults["sync.pause_mode"].startswith(f"keep (transport {transport!r} on cuda")
    again = cfg.replace(steps=3)
    assert again.sync.pause_mode == "keep" and "sync.pause_mode" in again.defaults
    assert placement.sync_of(cfg).transport == transport
    server = placement.server_config("Qwen/Qwen3-0.6B", cfg)
    assert server.weight_transfer_config == {"backend": transport}
    # a pause mode given is kept (and checked): "none" is refused on a CUDA transport
    _, given, _ = parse_config(["--transport", transport, "--set", "sync.pause_mode=wait"])
    assert given.sync.pause_mode == "wait" and "sync.pause_mode" not in given.defaults
    with pytest.raises(SystemExit):
        parse_config(["--transport", transport, "--set", "sync.pause_mode=none"])


def test_cli_transport_on_the_cpu_keeps_the_rings_pause_mode(monkeypatch) -> None:
    _fake_gpus(monkeypatch, 0)
    _, cfg, _ = parse_config(["--transport", "reload"])
    assert (cfg.sync.transport, cfg.sync.pause_mode) == ("reload", "none")
    assert cfg.defaults["sync.pause_mode"].startswith("none (vLLM's CPU engine")


class _Spawned(Exception):
    """Raised instead of starting the server: carries its command line and environment."""


def _spawn_args(monkeypatch: pytest.MonkeyPatch, scfg: Any, tmp_path: Path) -> tuple[list, dict]:
    """The command and environment ``VLLMServer.start`` would run the server with."""
    from grpo_nb.serving import server as server_mod

    def popen(cmd: list[str], **kwargs: Any) -> None:
        raise _Spawned(cmd, kwargs["env"])

    monkeypatch.setattr(server_mod.subprocess, "Popen", popen)
    scfg.log_dir = tmp_path
    server = server_mod.VLLMServer(scfg)
    try:
        with pytest.raises(_Spawned) as spawned:
            server._spawn()
    finally:
        server_mod._LIVE.discard(server)
    return spawned.value.args[0], spawned.value.args[1]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_server_runs_on_the_configs_device_not_wherever_cuda_is(monkeypatch, tmp_path,
                                                                    device) -> None:
    """CUDA present (faked): ``LLMConfig(device="cpu")`` starts vLLM's CPU engine (a KV cache
    in bytes, no GPU share), ``device="cuda"`` the GPU one."""
    from grpo_nb.serving import server as server_mod

    _fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(server_mod, "cuda_available", lambda: True)
    cfg = LLMConfig(device=device)
    scfg = placement.server_config("/m", cfg)
    assert scfg.device == device
    cmd, env = _spawn_args(monkeypatch, scfg, tmp_path)
    on_cpu = device == "cpu"
    assert (env.get("VLLM_TARGET_DEVICE") == "cpu") == on_cpu, env.get("VLLM_TARGET_DEVICE")
    assert ("--gpu-memory-utilization" in cmd) != on_cpu, cmd
    assert ("--kv-cache-memory-bytes" in cmd) == on_cpu, cmd
