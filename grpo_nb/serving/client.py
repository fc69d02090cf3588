"""An async client for vLLM's token-in/token-out ``/inference/v1/generate``: token ids in; token
ids, log-probs and the weight version that sampled each token out; aborted choices come back
with ``finish_reason="abort"`` for the caller to resample. ``/v1/completions`` serves the one
case of many prompts in one request (a greedy evaluation)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from grpo_nb.config import NonNegFloat, NonNegInt, PosFloat, PosInt, check_fields
from grpo_nb.serving.net import auth_headers, env_api_key

# Every sampling field vLLM could fill from the model folder's generation_config.json, at its
# neutral value: truncated sampling would renormalise the sampler's log-probs over the kept
# tokens, unlike the trainer's full softmax, and a fresh sample's PPO ratio would not be 1.
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0}


def policy_salt(version: int) -> str:
    """The ``cache_salt`` of requests sampled under weight ``version``: no request of a newer
    policy starts from prompt KV that older weights computed."""
    return f"policy-v{version}"


def span_labels(spans: list[dict[str, Any]], n_tokens: int) -> list[str]:
    """Each output token's weight-version label, from vLLM's ``weight_versions``: contiguous
    ``{"version", "start", "end"}`` spans of token indexes ``[start, end)`` that must tile
    ``0 .. n_tokens`` exactly (``ValueError`` otherwise)."""
    labels: list[str] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(labels) or end < start:
            raise ValueError(f"weight_versions span [{start}, {end}) does not start at token "
                             f"{len(labels)}: {spans}")
        labels += [str(span["version"])] * (end - start)
    if len(labels) != n_tokens:
        raise ValueError(f"weight_versions cover {len(labels)} tokens, not {n_tokens}: {spans}")
    return labels


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
    errors: list[str] = field(default_factory=list)  # last few messages, newest last


@dataclass
class Completion:
    """One sampled completion, aligned token by token with its log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    latency_s: float
    versions: list[str] | None = None  # each token's weight-version label, when the server sent it


@dataclass
class ClientConfig:
    """Client limits; ``retries`` applies to connection errors only."""

    max_in_flight: PosInt = 32  # requests at once (a semaphore)
    timeout_s: PosFloat = 120.0  # one request's bound
    retries: NonNegInt = 3  # extra tries after a connection error
    backoff_s: NonNegFloat = 0.25  # the first retry's wait, doubled for each next one
    api_key: str | None = field(default_factory=env_api_key, repr=False)  # sent as Bearer

    def __post_init__(self) -> None:
        check_fields(self)


class CompletionsClient:
    """Async client of one server's ``model`` (``async with``, or ``close()``); ``base_url``
    ends in ``/v1``, as :attr:`VLLMServer.base_url` does."""

    def __init__(self, base_url: str, model: str, cfg: ClientConfig | None = None, *,
                 api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.cfg = cfg or ClientConfig()
        self.api_key = api_key or self.cfg.api_key
        self.stats = ClientStats()
        self._sem = asyncio.Semaphore(self.cfg.max_in_flight)
        self._http: httpx.AsyncClient | None = None

    @classmethod
    def for_server(cls, server: Any, cfg: ClientConfig | None = None) -> CompletionsClient:
        return cls(server.base_url, server.model_name, cfg, api_key=server.api_key)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None or self._http.is_closed:
            # The semaphore is the limit, not the pool; timeout_s bounds each attempt as a whole.
            limits = httpx.Limits(max_connections=self.cfg.max_in_flight + 4)
            # trust_env=False: a proxy from HTTP_PROXY & co. never sees the loopback server
            self._http = httpx.AsyncClient(headers=auth_headers(self.api_key), limits=limits,
                                           timeout=None, trust_env=False)
        return self._http

    async def close(self) -> None:
        if self._http is not None:  # a closed one is replaced on the next request
            await self._http.aclose()

    async def __aenter__(self) -> CompletionsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _fail(self, kind: str, message: str, status: int | None = None) -> CompletionError:
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        self.stats.failed += 1
        self.stats.errors = (self.stats.errors + [f"{kind}: {message}"])[-20:]
        return CompletionError(kind, message, status)

    async def generate(self, prompt_ids: list[int], *, max_tokens: int = 16,
                       temperature: float = 1.0, top_p: float = 1.0, n: int = 1,
                       cache_salt: str | None = None, **extra: Any) -> list[Completion]:
        """Sample ``n`` completions of a token-id prompt through ``POST /inference/v1/generate``
        (a server started with ``--enable-scale-out``); raises :class:`CompletionError`. Each
        completion carries the weight-version label that sampled each token
        (``Completion.versions``, set by ``/update_weight_version``). ``extra`` joins
        ``sampling_params`` as is (``seed``, ``ignore_eos``, ``logit_bias`` …)."""
        params = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                  **NEUTRAL_SAMPLING, "n": n, "logprobs": 0, **extra}
        # output_mode "text": the server detokenizes the completion (the text the reward reads)
        body = {"model": self.model, "token_ids": list(prompt_ids), "output_mode": "text",
                "sampling_params": params, **({"cache_salt": cache_salt} if cache_salt else {})}
        url = f"{self.base_url.removesuffix('/v1')}/inference/v1/generate"
        async with self._sem:
            self.stats.requests += 1
            return await self._post_with_retries(body, url)

    async def complete(self, prompts: list[list[int]], *, max_tokens: int = 16,
                       temperature: float = 1.0, cache_salt: str | None = None
                       ) -> list[Completion]:
        """One completion of each token-id prompt in one ``POST /v1/completions`` (choices in
        prompt order), for many prompts at once: :meth:`generate` takes one prompt a request,
        and an evaluation of 256 prompts as 256 requests took ≈ 5× as long on 2 cores (the
        API server's per-request work). No weight-version labels."""
        body = {"model": self.model, "prompt": prompts, "max_tokens": max_tokens,
                "temperature": temperature, **NEUTRAL_SAMPLING, "n": 1, "logprobs": 0,
                "return_token_ids": True, **({"cache_salt": cache_salt} if cache_salt else {})}
        async with self._sem:
            self.stats.requests += 1
            return await self._post_with_retries(body, f"{self.base_url}/completions")

    async def _post_with_retries(self, body: dict[str, Any], url: str) -> list[Completion]:
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
            if (code := resp.status_code) >= 400:
                raise self._fail("http_4xx" if code < 500 else "http_5xx",
                                 f"HTTP {code} from {url}: {resp.text[:500]}", code)
            return self._parse(resp.json(), time.perf_counter() - t0)
        raise AssertionError("unreachable")

    def _parse(self, payload: dict[str, Any], latency: float) -> list[Completion]:
        out = []
        for choice in payload.get("choices", []):
            ids = list(choice.get("token_ids") or [])
            lp = choice.get("logprobs") or {}  # /v1/completions' shape, else generate's
            lps = [float(x) for x in lp["token_logprobs"] or []] if "token_logprobs" in lp \
                else [float(c["logprob"]) for c in lp.get("content") or []]
            reason, text = choice.get("finish_reason"), choice.get("text") or ""
            versions = None
            if choice.get("weight_versions") is not None:
                try:
                    versions = span_labels(choice["weight_versions"], len(ids))
                except (ValueError, KeyError, TypeError) as err:
                    raise self._fail("http_5xx", f"malformed weight_versions: {err}") from err
            if reason == "abort":  # cut short by the server, maybe with no token: returned
                self.stats.aborted += 1
                ids, lps = ids[:len(lps)], lps[:len(ids)]
                versions = None if versions is None else versions[:len(ids)]
            elif not ids:
                raise self._fail("empty", f"completion with no tokens (finish_reason={reason!r})")
            elif len(lps) != len(ids):
                raise self._fail("http_5xx", f"{len(ids)} token ids but {len(lps)} log-probs")
            elif not text:
                self.stats.empty_text += 1
            out.append(Completion(ids, lps, text, reason, latency, versions))
        if not out:
            raise self._fail("empty", "response without choices")
        self.stats.ok += 1
        return out
