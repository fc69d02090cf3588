"""The trainer's HTTP control plane to one vLLM server (dev-mode routes, loopback only), beside
the sampling client (client.py): pause, the weight-update routes, worker RPCs, the served version
and log-probs. Every call is counted and raises :class:`WeightSyncError` on a non-2xx answer or a
dead server."""

from __future__ import annotations

import threading
import time
from typing import Any

from grpo_nb.serving.net import auth_headers, env_api_key, http


class WeightSyncError(RuntimeError):
    """A weight sync (or its verification) failed; the trainer's version must not advance.
    ``status``: the HTTP status the server answered with (None: no answer, or no request)."""

    status: int | None = None


class VLLMControlClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over HTTP, plus pause, RPCs and log-probs."""

    def __init__(self, base_url: str, timeout: float = 60.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key or env_api_key()  # a keyed server answers 401 on /v1 without it
        self.round_trips = 0
        # Bounds start / update / finish of a weight update, whose time grows with the model's
        # bytes (the syncer sets it: WeightSyncConfig.transfer_timeout); None: ``timeout``.
        self.update_timeout: float | None = None
        self._count_lock = threading.Lock()
        self._model: str | None = None

    def __repr__(self) -> str:  # never show the key
        return f"VLLMControlClient({self.base_url!r}, timeout={self.timeout})"

    # vLLM's VLLMWeightSyncClient protocol: these four methods
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "start_weight_update", timeout=self.update_timeout)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        from grpo_nb.weight_sync.vllm_compat import json_safe_update_payload

        # CUDA-IPC handles are not JSON: vLLM's encoding pickles them (ipc engine only).
        self._request("POST", "update_weights", timeout=self.update_timeout,
                      json={"update_info": json_safe_update_payload(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._request("POST", "finish_weight_update", json=body, timeout=self.update_timeout)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx  # here: configuring a sync (and the GPU probe) needs no httpx

        url = f"{self.base_url}/{path.lstrip('/')}"
        with self._count_lock:
            self.round_trips += 1
        try:
            response = http().request(method, url, timeout=kwargs.pop("timeout", None)
                                      or self.timeout, headers=auth_headers(self.api_key), **kwargs)
        except httpx.TransportError as err:
            raise WeightSyncError(f"{method} {url}: {type(err).__name__}: {err}") from err
        if not response.is_success:
            refused = WeightSyncError(f"{method} {url} → HTTP {response.status_code}: "
                                      f"{response.text[:500]}")
            refused.status = response.status_code
            raise refused
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
        """Call a worker method (weight_sync/server_side.py); ``timeout`` bounds this HTTP call only (vLLM's RPC
        timeout would leave a late reply queued for the next call)."""
        response = self._request("POST", "collective_rpc", timeout=timeout,
                                 json={"method": method, "kwargs": kwargs or {}})
        return response.json().get("results", []) if response.content else []

    def wait_running(self, at_least: int = 1, timeout: float = 10.0) -> bool:
        """Block until the engine decodes ``at_least`` requests (its ``vllm:num_requests_running``
        gauge); False after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self._request("GET", "metrics").text.splitlines()
            if sum(float(line.split()[-1]) for line in metrics
                   if line.startswith("vllm:num_requests_running")) >= at_least:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def weight_checksums(self, timeout: float | None = None) -> dict[str, str]:
        """vLLM's ``/weight_checker`` (``checksum``): sha256 of every parameter the served model
        holds, as loaded and processed, keyed ``dp0:pp0:pcp0:tp0:<name>`` (one per worker)."""
        reply = self._request("POST", "weight_checker", json={"action": "checksum"},
                              timeout=timeout)
        return dict(reply.json()["checksums"])

    def weight_version(self) -> str | None:
        return self._request("GET", "weight_info").json().get("weight_version")

    def reset_prefix_cache(self) -> bool:
        """Drop the server's cached prompt KV; False while requests in flight still hold it."""
        return bool(self._request("POST", "reset_prefix_cache").json().get("success"))

    def set_weight_version(self, version: str) -> None:
        self._request("POST", "update_weight_version", json={"new_version": version})

    def model_name(self) -> str:
        if self._model is None:
            self._model = self._request("GET", "v1/models").json()["data"][0]["id"]
        return self._model

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The served model's log-prob of each token after the first, given those before it
        (temperature 1); a first such request compiles kernels, hence the long timeout."""
        rows = []
        for seq in sequences:
            body = {"model": self.model_name(), "prompt": list(seq), "max_tokens": 1,
                    "temperature": 0.0, "prompt_logprobs": 0}
            reply = self._request("POST", "v1/completions", json=body,
                                  timeout=max(self.timeout, 120.0)).json()
            entries = reply["choices"][0].get("prompt_logprobs") or []
            if len(entries) != len(seq):
                raise WeightSyncError(f"server returned {len(entries)} prompt log-probs for "
                                      f"{len(seq)} tokens")
            rows.append([float(entries[i][str(tok)]["logprob"])
                         for i, tok in enumerate(seq) if i > 0])
        return rows
