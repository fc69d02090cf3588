"""Loopback HTTP ignores proxies: every httpx client the package makes has ``trust_env=False``,
so ``HTTP_PROXY`` & co. (a cluster's, set without ``NO_PROXY=127.0.0.1``) never receive the
requests meant for the server on loopback. With every proxy variable pointing at a dead port,
the package's clients still reach a loopback server (a server's start waits on the same
``healthy()`` call). The command line runs under the same dead proxies where it already meets
a real server, ``rollouts --attach`` against the session's (test_rollouts.py): no server is
started for this file alone.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM

DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens there
PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
              "all_proxy")


def proxied_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with every proxy variable at a dead port and no NO_PROXY (test_rollouts.py's
    attached CLI runs under it too)."""
    out = {k: v for k, v in env.items() if k not in ("NO_PROXY", "no_proxy")}
    return {**out, **dict.fromkeys(PROXY_VARS, DEAD_PROXY)}


@pytest.fixture
def loopback() -> Iterator[FakeVLLM]:
    """The tests' fake vLLM server on loopback; it records each path asked."""
    with FakeVLLM() as fake:
        yield fake


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


def test_the_packages_clients_reach_loopback_past_a_dead_proxy(monkeypatch, loopback) -> None:
    """The server's health and attach calls, the weight-sync control client and the
    completions client all reach the loopback server; a client that trusts the environment
    (httpx's default) sends the same request to the dead proxy and fails."""
    from grpo_nb.serving.client import CompletionsClient
    from grpo_nb.serving.control import VLLMControlClient
    from grpo_nb.serving.server import VLLMServer

    loopback_url = loopback.url
    for key, value in proxied_env(dict(os.environ)).items():
        monkeypatch.setenv(key, value)
    for key in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(httpx.TransportError):  # the proxy variables are in force
        httpx.get(f"{loopback_url}/health", timeout=5)
    assert loopback.paths == []

    server = _in_a_fresh_thread(lambda: VLLMServer.attach(loopback_url))
    assert server.model_name == "m"
    assert _in_a_fresh_thread(server.healthy) is True
    _in_a_fresh_thread(lambda: VLLMControlClient(loopback_url, timeout=5).pause("keep"))

    async def complete() -> int:
        async with CompletionsClient(f"{loopback_url}/v1", "m") as client:
            return (await client._client().get(f"{loopback_url}/health", timeout=5)).status_code

    assert asyncio.run(complete()) == 200
    assert loopback.paths == ["/v1/models", "/health", "/pause?mode=keep", "/health"]
