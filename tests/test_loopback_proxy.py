"""Loopback HTTP ignores proxies: every httpx client the package makes has ``trust_env=False``,
so ``HTTP_PROXY`` & co. (a cluster's, set without ``NO_PROXY=127.0.0.1``) never receive the
requests meant for the server on loopback. With every proxy variable pointing at a dead port,
the package's clients still reach a loopback server, and ``rollouts --smoke`` still runs.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens there
PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
              "all_proxy")


def _proxied_env(env: dict[str, str]) -> dict[str, str]:
    out = {k: v for k, v in env.items() if k not in ("NO_PROXY", "no_proxy")}
    return {**out, **dict.fromkeys(PROXY_VARS, DEAD_PROXY)}


class _Handler(http.server.BaseHTTPRequestHandler):
    """A vLLM-shaped loopback server: ``/v1/models`` names one model, every other route
    answers ``{}``; each path asked is recorded."""

    seen: list[str] = []

    def _answer(self) -> None:
        self.seen.append(self.path)
        body = {"data": [{"id": "m"}]} if self.path == "/v1/models" else {}
        data = json.dumps(body).encode()
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def loopback_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Handler.seen = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _in_a_fresh_thread(fn: Any) -> Any:
    """``fn()`` on a new thread: ``serving.net.http()`` makes one client per thread, so this
    one is made under the proxy variables set now."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(_capture(fn)))
    thread.start()
    thread.join(30)
    (result,) = out
    if isinstance(result, BaseException):
        raise result
    return result


def _capture(fn: Any) -> Any:
    try:
        return fn()
    except BaseException as err:  # re-raised by the caller's thread
        return err


def test_the_packages_clients_reach_loopback_past_a_dead_proxy(monkeypatch,
                                                                loopback_url) -> None:
    """The server's health and attach calls, the weight-sync control client and the
    completions client all reach the loopback server; a client that trusts the environment
    (httpx's default) sends the same request to the dead proxy and fails."""
    from grpo_nb.serving.client import CompletionsClient
    from grpo_nb.serving.server import VLLMServer
    from grpo_nb.weight_sync.client import VLLMControlClient

    for key, value in _proxied_env(dict(os.environ)).items():
        monkeypatch.setenv(key, value)
    for key in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(httpx.TransportError):  # the proxy variables are in force
        httpx.get(f"{loopback_url}/health", timeout=5)
    assert _Handler.seen == []

    server = _in_a_fresh_thread(lambda: VLLMServer.attach(loopback_url))
    assert server.model_name == "m"
    assert _in_a_fresh_thread(server.healthy) is True
    _in_a_fresh_thread(lambda: VLLMControlClient(loopback_url, timeout=5).pause("keep"))

    async def complete() -> int:
        async with CompletionsClient(f"{loopback_url}/v1", "m") as client:
            return (await client._client().get(f"{loopback_url}/health", timeout=5)).status_code

    assert asyncio.run(complete()) == 200
    assert _Handler.seen == ["/v1/models", "/health", "/pause?mode=keep", "/health"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rollouts_cli_runs_with_every_proxy_variable_dead(tiny_model_dir: Path) -> None:
    """``rollouts --smoke`` starts its own vLLM server, waits for ``/health``, samples and
    stops it, with HTTP_PROXY, HTTPS_PROXY and ALL_PROXY (both cases) at a dead port and no
    NO_PROXY: every loopback call bypasses the proxy."""
    env = {**_proxied_env(dict(os.environ)), "GRPO_NB_SERVER_EAGER": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_nb", "rollouts", "--smoke", "--model", str(tiny_model_dir),
         "--groups", "2", "--group-size", "2"],
        capture_output=True, text=True, timeout=800, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["groups"] == 2 and result["samples"] == 4 and result["failed_requests"] == 0
