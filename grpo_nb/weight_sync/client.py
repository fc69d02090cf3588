"""The trainer's HTTP control plane to one vLLM server (dev-mode routes, loopback only).

vLLM's trainer engines drive a server through four calls (its ``VLLMWeightSyncClient``
protocol, as in vLLM's own ``HTTPVLLMWeightSyncClient``); this client implements them and adds
the routes around them::

    WeightSyncer ──► VLLMControlClient ──HTTP──► /pause?mode=…  /resume
                          │                       /init_weight_transfer_engine, /start_…,
                          │                       /update_weights, /finish_weight_update
                          └──────────────────────► /collective_rpc  /weight_info  /v1/…
                                                   /update_weight_version

Every call raises on a non-2xx answer or a dead server (``httpx`` raises ``ConnectError`` at
once when nothing listens), so a failed sync can never go unnoticed. Connections are kept
alive (:func:`grpo_nb.serving.net.http`), and every call is counted in
:attr:`VLLMControlClient.round_trips`.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import httpx

from grpo_nb.serving.net import http


class WeightSyncError(RuntimeError):
    """A weight sync (or its verification) failed; the trainer's version must not advance."""


def policy_salt(version: int) -> str:
    """The ``cache_salt`` of requests sampled under weight ``version``: vLLM reuses cached
    prompt KV only between requests with the same salt, so no request of a newer policy starts
    from KV that older weights computed (a sync with ``pause_mode="none"`` leaves that KV cached
    while requests are in flight)."""
    return f"policy-v{version}"


class VLLMControlClient:
    """vLLM's weight-sync client protocol over HTTP, plus pause / resume / RPC / version.

    It implements vLLM's ``VLLMWeightSyncClient`` protocol (structural: the four methods
    below) without importing vLLM, so the trainer side also loads where vLLM is absent.
    """

    def __init__(self, base_url: str, timeout: float = 60.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        # A keyed server answers 401 on /v1 routes without it (verify() uses them).
        self.api_key = api_key or os.environ.get("VLLM_API_KEY") or None
        self.round_trips = 0
        self._count_lock = threading.Lock()

    def __repr__(self) -> str:  # never show the key
        return f"VLLMControlClient({self.base_url!r}, timeout={self.timeout})"

    # ── vLLM's VLLMWeightSyncClient protocol ──

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

        # CUDA-IPC handles are not JSON: vLLM's helper pickles them (ipc engine only).
        self._request("POST", "update_weights",
                      json={"update_info": _json_safe_update_payload(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._request("POST", "finish_weight_update", json=body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._request("POST", "shutdown_weight_transfer_engine")

    # ── the routes around them ──

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        url = f"{self.base_url}/{path.lstrip('/')}"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        with self._count_lock:
            self.round_trips += 1
        try:
            response = http().request(method, url, timeout=kwargs.pop("timeout", None)
                                      or self.timeout, headers=headers, **kwargs)
        except httpx.TransportError as err:
            raise WeightSyncError(f"{method} {url}: {type(err).__name__}: {err}") from err
        if not response.is_success:
            raise WeightSyncError(f"{method} {url} → HTTP {response.status_code}: "
                                  f"{response.text[:500]}")
        return response

    def pause(self, mode: str = "keep") -> None:
        """Stop scheduling: ``keep`` freezes requests, ``wait`` drains, ``abort`` ends them."""
        self._request("POST", "pause", params={"mode": mode})

    def resume(self) -> None:
        self._request("POST", "resume")

    def is_paused(self) -> bool:
        """The scheduler's pause state (``/health`` answers 200 either way)."""
        return bool(self._request("GET", "is_paused").json()["is_paused"])

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Call a worker method (ours: worker.py); ``timeout`` bounds this HTTP call only.

        vLLM's own RPC timeout (a ``timeout`` in the body) is never used: when it fires, the
        worker's late reply stays queued in the engine and every later RPC receives its
        predecessor's reply (``MultiprocExecutor.collective_rpc`` dequeues one reply per
        call). A call the client gave up on completes inside the server instead, and the
        replies stay in step.
        """
        body: dict[str, Any] = {"method": method, "kwargs": kwargs or {}}
        response = self._request("POST", "collective_rpc", json=body, timeout=timeout)
        return response.json().get("results", []) if response.content else []

    def running_requests(self) -> int:
        """Requests the engine is decoding now: vLLM's ``vllm:num_requests_running`` gauge
        (``/metrics``, Prometheus text; summed over its engines)."""
        text = self._request("GET", "metrics").text
        return int(sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("vllm:num_requests_running")))

    def wait_running(self, at_least: int = 1, timeout: float = 10.0) -> bool:
        """Wait until the engine decodes ``at_least`` requests; False if it does not within
        ``timeout`` seconds. Blocks: from ``asyncio`` code, run it in a thread, or the
        requests it waits for are never sent."""
        deadline = time.monotonic() + timeout
        while self.running_requests() < at_least:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def weight_version(self) -> str | None:
        return self._request("GET", "weight_info").json().get("weight_version")

    def reset_prefix_cache(self) -> bool:
        """Drop the server's cached prompt KV; False while requests in flight still hold it."""
        return bool(self._request("POST", "reset_prefix_cache").json().get("success"))

    def set_weight_version(self, version: str) -> None:
        self._request("POST", "update_weight_version", json={"new_version": version})

    def model_name(self) -> str:
        return self._request("GET", "v1/models").json()["data"][0]["id"]

    def completions(self, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        return self._request("POST", "v1/completions", json=body, timeout=timeout).json()
