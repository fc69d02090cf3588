"""What the GPU placement cannot carry is refused when the config is resolved, naming the setting
and the fix; what it can carry works from the command line; the server runs on the device
the config names. CUDA is faked (``placement``'s probes and ``torch.cuda.is_available``, as
in test_gpu_path.py); no GPU, no server.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_nb.llm import cost, placement
from grpo_nb.llm.cli import parse_config
from grpo_nb.llm.config import LLMConfig

H100, H200 = 85_029_158_912, 150_121_594_880  # torch's total_memory of an 80 GB / 141 GB card


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, gpus: int, total: int = H100) -> None:
    monkeypatch.setattr(placement, "cuda_available", lambda: gpus > 0)
    monkeypatch.setattr(placement, "gpu_count", lambda: gpus)
    monkeypatch.setattr(placement, "gpu_total_bytes", lambda: total)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)


def test_nccl_on_one_gpu_is_refused_naming_the_setting_and_the_fix(monkeypatch, capsys) -> None:
    """One GPU holds the server and the trainer: NCCL refuses two ranks on one device, so
    ``nccl`` is refused (in the config and on the command line) and ``ipc`` offered."""
    _fake_gpus(monkeypatch, 1)
    why = (r"LLMConfig\.sync\.transport='nccl' needs two GPUs, but 1 is visible.*"
           r"Duplicate GPU detected.*Use sync\.transport='ipc'")
    with pytest.raises(ValueError, match=why):
        LLMConfig(sync={"transport": "nccl"}).resolve()
    with pytest.raises(ValueError, match=why):
        LLMConfig().resolve().replace(sync={"transport": "nccl", "pause_mode": "keep"})
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
        LLMConfig(sync={"transport": "ipc"}).resolve()
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


QWEN_CLI = ["--model", "Qwen/Qwen3-0.6B", "--dataset", "openai/gsm8k"]


@pytest.mark.parametrize(("total", "share"), [(H100, 0.20), (H200, 0.12), (24 * 10**9, 0.71)])
def test_a_shared_gpus_server_share_is_its_computed_need(monkeypatch, total, share) -> None:
    """One GPU: the CLI default's server (Qwen3-0.6B, 2 generators × 64 requests, 512 tokens)
    gets bf16 weights 2 × 596,049,920 B + KV 1.2 × (128 + 64) × 512 × 114,688 B + 2 GiB =
    16,868,730,470 B of the card, rounded up to 0.01 — and the trainer's peak fits beside it
    on an 80 GB card."""
    _fake_gpus(monkeypatch, 1, total)
    _, cfg, _ = parse_config(QWEN_CLI)
    need = 2 * 596_049_920 + int(1.2 * 192 * 512 * 114_688) + (2 << 30)
    assert need == 16_868_730_470 and math.ceil(100 * need / total) / 100 == share
    assert placement.server_config("Qwen/Qwen3-0.6B", cfg).gpu_memory_utilization == share
    trainer = cost.memory_plan(cost.QWEN3["Qwen3-0.6B"], sequences=cfg.batch_size,
                               prompt_len=cfg.max_prompt_len, completion_len=cfg.max_tokens,
                               server_seqs=cfg.generators * cfg.max_inflight).trainer_peak
    assert (share * total + 1.1 * trainer <= total) == (total >= H100)


def test_the_share_reads_a_model_folders_shape_and_keeps_what_is_set(monkeypatch,
                                                                     tmp_path) -> None:
    """A folder's config.json gives the shape (twice the KV heads: more KV); a share given in
    the config is kept; an unknown model gets the fallback; a GPU of its own 0.85."""
    _fake_gpus(monkeypatch, 1, H200)
    _, cfg, _ = parse_config(QWEN_CLI)
    hf = {"hidden_size": 1024, "num_hidden_layers": 28, "vocab_size": 151936,
          "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
          "intermediate_size": 3072, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    need = 2 * 596_049_920 + int(1.2 * 192 * 512 * 2 * 114_688) + (2 << 30)
    assert placement.server_config(str(tmp_path), cfg).gpu_memory_utilization == \
        math.ceil(100 * need / H200) / 100 == 0.21
    assert placement.server_config(str(tmp_path), cfg.replace(gpu_memory_utilization=0.5)
                                   ).gpu_memory_utilization == 0.5
    assert placement.server_config("/m", cfg).gpu_memory_utilization == \
        placement.SHARED_GPU_FALLBACK
    _fake_gpus(monkeypatch, 2, H200)
    assert placement.server_config(str(tmp_path), cfg).gpu_memory_utilization == 0.85
