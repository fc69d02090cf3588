"""An async client for vLLM's ``/v1/completions``: token ids in, token ids and log-probs out.

Rollouts need the *exact* tokens the sampler produced and their log-probabilities (GRPO's
importance ratio divides by them), so the client sends token-id prompts and asks vLLM for
``return_token_ids`` and ``logprobs``. It never loses a request quietly::

    complete(prompt_ids) ──► semaphore (≤ max_in_flight) ──► httpx POST /v1/completions
                                                               │
         connection error ──► retry with backoff (≤ retries) ─┤
         timeout / 4xx / 5xx / empty ──► counted in ClientStats, raised as CompletionError
                                         (.status: this request's HTTP status, if any)
         aborted (/pause mode=abort) ──► Completion(finish_reason="abort"), maybe no tokens:
                                         returned and counted, never raised — the caller
                                         must not score it as a finished sample
         ok ──► Completion(token_ids, logprobs, text, finish_reason)  (counted too)

Every request carries ``Authorization: Bearer <key>`` when a key is known (``api_key=``,
``ClientConfig.api_key``, or ``$VLLM_API_KEY``): a keyed server answers 401 without it.

Every outcome lands in :class:`ClientStats` (and, when a recorder is given, as a
``kind="request"`` or ``kind="client_error"`` metrics row).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from grpo_nb.metrics import MetricsRecorder

# Every sampling parameter vLLM fills from the model folder's generation_config.json when a
# request leaves it unset (``--generation-config auto``, vLLM's default; Qwen3 folders ship
# top_k 20, top_p 0.95, temperature 0.6), at vLLM's neutral value. Under truncation the
# sampler's processed log-probs are renormalised over the kept tokens, unlike the trainer's
# full softmax, and the PPO ratio of a fresh sample is not 1.
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0}


def sampling_fields(temperature: float, top_p: float = 1.0) -> dict[str, float | int]:
    """Every sampling field of a ``/v1/completions`` request, set explicitly: ``temperature``
    and ``top_p`` as given, the rest at :data:`NEUTRAL_SAMPLING`. The one place the request's
    sampling fields are defined (:meth:`CompletionsClient.complete` sends them)."""
    return {"temperature": temperature, "top_p": top_p, **NEUTRAL_SAMPLING}


class CompletionError(RuntimeError):
    """A request that failed for good. ``kind`` names the counter it was added to."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status


@dataclass
class ClientStats:
    """Counters of every request outcome. ``failed`` = requests that raised."""

    requests: int = 0
    ok: int = 0
    failed: int = 0
    retries: int = 0
    connection_errors: int = 0
    timeouts: int = 0
    http_4xx: int = 0
    http_5xx: int = 0
    empty: int = 0  # finished with no token at all: raised
    aborted: int = 0  # choices ended by the server (finish_reason="abort"): returned
    empty_text: int = 0  # only special tokens (e.g. <eos> first): kept, counted
    groups_dropped: int = 0  # groups given up because a sample failed (rollouts.iter_groups)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)  # last few messages, newest last


@dataclass
class Completion:
    """One sampled completion, aligned token by token with its log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    latency_s: float
    prompt_token_ids: list[int] | None = None


@dataclass
class ClientConfig:
    """Client limits. ``retries`` applies to connection errors only (not to HTTP errors).

    ``api_key`` (default ``$VLLM_API_KEY``; hidden from ``repr``) is sent on every request.
    """

    max_in_flight: int = 32
    timeout_s: float = 120.0
    retries: int = 3
    backoff_s: float = 0.25
    api_key: str | None = field(default_factory=lambda: os.environ.get("VLLM_API_KEY") or None,
                                repr=False)

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"ClientConfig.max_in_flight={self.max_in_flight}: must be ≥ 1")
        if self.timeout_s <= 0:
            raise ValueError(f"ClientConfig.timeout_s={self.timeout_s}: must be > 0")
        if self.retries < 0:
            raise ValueError(f"ClientConfig.retries={self.retries}: must be ≥ 0")

    @classmethod
    def smoke(cls) -> ClientConfig:
        return cls(max_in_flight=16, timeout_s=60.0)


class CompletionsClient:
    """Async client bound to one server and model. Use ``async with`` or call ``close()``.

    Args:
        base_url: ``http://host:port/v1`` (``VLLMServer.base_url``).
        model: the served model name (``VLLMServer.model_name``).
        cfg: limits; ``api_key`` overrides ``cfg.api_key``; ``recorder``: optional metrics sink.
    """

    def __init__(self, base_url: str, model: str, cfg: ClientConfig | None = None, *,
                 api_key: str | None = None, recorder: MetricsRecorder | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.cfg = cfg or ClientConfig()
        self.api_key = api_key or self.cfg.api_key
        self.recorder = recorder
        self.stats = ClientStats()
        self._sem = asyncio.Semaphore(self.cfg.max_in_flight)
        self._http: httpx.AsyncClient | None = None
        self.in_flight = 0

    @classmethod
    def for_server(cls, server: Any, cfg: ClientConfig | None = None, **kw: Any
                   ) -> CompletionsClient:
        return cls(server.base_url, server.model_name, cfg, api_key=server.api_key, **kw)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None or self._http.is_closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # The semaphore is the limit that matters; the pool must not be a tighter one.
            # No httpx timeout: ClientConfig.timeout_s bounds each attempt as a whole.
            limits = httpx.Limits(max_connections=self.cfg.max_in_flight + 4)
            self._http = httpx.AsyncClient(headers=headers, limits=limits, timeout=None)
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> CompletionsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _fail(self, kind: str, message: str, status: int | None = None) -> CompletionError:
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        self.stats.failed += 1
        self.stats.errors = (self.stats.errors + [f"{kind}: {message}"])[-20:]
        if self.recorder is not None:
            self.recorder.log("client_error", error=kind, status=status, message=message[:300])
        return CompletionError(kind, message, status)

    async def complete(self, prompt_ids: list[int], *, max_tokens: int = 16,
                       temperature: float = 1.0, top_p: float = 1.0, n: int = 1,
                       seed: int | None = None, **extra: Any) -> list[Completion]:
        """Sample ``n`` completions of a token-id prompt; raises :class:`CompletionError`.

        Every sampling field is sent (:func:`sampling_fields`), so the model folder's
        ``generation_config.json`` never changes what is sampled. ``extra`` goes into the
        request body as is (e.g. ``ignore_eos``, ``logit_bias``, ``cache_salt``).
        """
        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                **sampling_fields(temperature, top_p), "n": n, "logprobs": 1,
                "return_token_ids": True, **extra}
        if seed is not None:
            body["seed"] = seed
        async with self._sem:
            self.in_flight += 1
            self.stats.requests += 1
            try:
                return await self._post_with_retries(body)
            finally:
                self.in_flight -= 1

    async def _post_with_retries(self, body: dict[str, Any]) -> list[Completion]:
        url = f"{self.base_url}/completions"
        for attempt in range(self.cfg.retries + 1):
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(self.cfg.timeout_s):
                    resp = await self._client().post(url, json=body)
            # No connection, or one closed before the whole answer came: worth another try.
            except (httpx.NetworkError, httpx.RemoteProtocolError) as err:
                if attempt < self.cfg.retries:
                    self.stats.retries += 1
                    await asyncio.sleep(self.cfg.backoff_s * 2**attempt)
                    continue
                raise self._fail("connection_errors",
                                 f"{url} unreachable after {attempt + 1} attempts: {err!r}"
                                 ) from err
            except TimeoutError as err:
                raise self._fail("timeouts", f"no answer within {self.cfg.timeout_s} s "
                                 f"(ClientConfig.timeout_s) from {url}") from err
            if resp.status_code >= 400:
                kind = "http_4xx" if resp.status_code < 500 else "http_5xx"
                raise self._fail(kind, f"HTTP {resp.status_code} from {url}: {resp.text[:500]}",
                                 resp.status_code)
            return self._parse(resp.json(), time.perf_counter() - t0)
        raise AssertionError("unreachable")

    def _parse(self, payload: dict[str, Any], latency: float) -> list[Completion]:
        out = []
        for choice in payload.get("choices", []):
            ids = list(choice.get("token_ids") or [])
            lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if choice.get("finish_reason") == "abort":
                # Cut short by the server (e.g. /pause?mode=abort): the caller decides.
                self.stats.aborted += 1
                k = min(len(ids), len(lps))
                out.append(Completion(ids[:k], [float(x) for x in lps[:k]],
                                      choice.get("text") or "", "abort", latency,
                                      choice.get("prompt_token_ids")))
                continue
            if not ids:
                raise self._fail("empty", f"completion with no tokens "
                                 f"(finish_reason={choice.get('finish_reason')!r})")
            if len(lps) != len(ids):
                raise self._fail("http_5xx", f"{len(ids)} token ids but {len(lps)} log-probs")
            if not choice.get("text"):
                self.stats.empty_text += 1
            out.append(Completion(token_ids=ids, logprobs=[float(x) for x in lps],
                                  text=choice.get("text") or "",
                                  finish_reason=choice.get("finish_reason"), latency_s=latency,
                                  prompt_token_ids=choice.get("prompt_token_ids")))
        if not out:
            raise self._fail("empty", "response without choices")
        self.stats.ok += 1
        self.stats.prompt_tokens += len(out[0].prompt_token_ids or [])
        self.stats.completion_tokens += sum(len(c.token_ids) for c in out)
        if self.recorder is not None:
            self.recorder.log("request", latency_s=latency, in_flight=self.in_flight,
                              tokens=sum(len(c.token_ids) for c in out))
        return out
