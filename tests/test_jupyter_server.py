"""The browser tests' JupyterLab server survives a port taken between choosing and binding it.

``free_port()`` releases the port it found before ``jupyter lab`` binds it; under ``make test``
other lanes start vLLM servers and open connections meanwhile, so the port can be taken. The
server then exits 1; the helper must start again on a new port, and say why when it gives up.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import browser_helpers
import pytest
from browser_helpers import JupyterServer


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port with a listening socket on it, as another process would hold it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _ports_first(taken: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make free_port() hand out ``taken`` first, then truly free ports; returns those handed."""
    handed: list[int] = []
    real = browser_helpers.free_port

    def first_taken() -> int:
        handed.append(taken if not handed else real())
        return handed[-1]

    monkeypatch.setattr(browser_helpers, "free_port", first_taken)
    return handed


def test_a_taken_port_is_retried_on_a_new_one(tmp_path: Path, taken_port: int, monkeypatch):
    handed = _ports_first(taken_port, monkeypatch)
    with JupyterServer(tmp_path, tmp_path / "lab.log") as server:
        server.wait_ready(timeout_s=180)
        assert server.starts == 2 and server.port == handed[1] != taken_port
        assert "kernels" in json.loads(server.api("/api/status"))
    log = (tmp_path / "lab.log").read_text()
    assert f"port {taken_port} is not available" in log, log[-2000:]


def test_giving_up_shows_why_from_the_log(tmp_path: Path, taken_port: int, monkeypatch):
    _ports_first(taken_port, monkeypatch)
    with JupyterServer(tmp_path, tmp_path / "lab.log") as server:
        with pytest.raises(RuntimeError) as err:
            server.wait_ready(timeout_s=180, max_starts=1)
        assert server.token not in str(err.value)
    assert "exited with 1 (start 1)" in str(err.value)
    assert f"port {taken_port} is not available" in str(err.value)
