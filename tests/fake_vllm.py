"""The tests' one stand-in for a vLLM 0.32 server: a loopback HTTP server (a thread per request)
answering the routes the package calls, in the shapes vLLM's own routes answer them, so the
package's real clients (``CompletionsClient``, ``VLLMControlClient``, ``VLLMServer.attach``)
talk to it unchanged.

Routes (vLLM's source for each shape: ``entrypoints/openai/completion/protocol.py``,
``entrypoints/scale_out/token_in_token_out/protocol.py``, ``entrypoints/rl/online/api_router.py``,
``entrypoints/serve/dev/{rpc,cache}/api_router.py``):

- ``GET /health`` (empty 200), ``GET /v1/models``, ``GET /metrics`` (the
  ``vllm:num_requests_running`` gauge: requests decoding now);
- ``POST /v1/completions`` (``prompt``: one token-id list or a batch of them; ``prompt_logprobs``
  answered from :attr:`FakeVLLM.prompt_logprob`) and ``POST /inference/v1/generate`` (its
  ``weight_versions`` span: the weight version served when the request finished);
- ``POST /pause?mode=abort|wait|keep``, ``/resume``, ``GET /is_paused``: a request sent while
  paused waits for ``/resume``; ``abort`` ends those decoding with ``finish_reason="abort"``,
  ``wait`` returns once they have finished, ``keep`` leaves them decoding;
- ``POST /update_weight_version`` and ``GET /weight_info`` (starts at vLLM's ``"default"``),
  ``/reset_prefix_cache``, the four weight-transfer routes, ``/weight_checker``, and
  ``/collective_rpc`` (methods in :attr:`FakeVLLM.rpc`, one worker's results; another method
  answers 500, as vLLM's worker lacks it).

Knobs: :attr:`~FakeVLLM.sampler` (what a completion samples), :attr:`~FakeVLLM.answer` (a raw
``(status, body)`` for any request, before the route runs), ``fail`` (routes answering 500),
``slow`` (route → seconds before answering), ``decode_s`` (how long each completion decodes),
``burst`` (the running gauge reads 0 until that many requests decode at once: a burst a real
server schedules in one step, however slowly a loaded client writes it).
Every request is recorded in :attr:`~FakeVLLM.requests`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs


@dataclass
class Sample:
    """One sampled completion as the fake serves it."""

    text: str = "7"
    token_ids: list[int] = field(default_factory=lambda: [5])
    logprobs: list[float] | None = None  # None: -1.0 for every token
    finish_reason: str = "stop"


@dataclass
class Request:
    """One request the fake received."""

    method: str
    route: str  # the path without its query
    query: str
    body: Any
    headers: Message  # case-insensitive ``get``, as http.server parsed them


SAMPLING_ROUTES = ("/v1/completions", "/inference/v1/generate")
Sampler = Callable[[list[int], dict[str, Any]], list[Sample]]


def one_sample_each(prompt: list[int], params: dict[str, Any]) -> list[Sample]:
    """The default sampler: ``n`` copies of ``Sample()``."""
    return [Sample() for _ in range(int(params.get("n", 1)))]


def scripted(replies: Iterable[list[tuple[str, str]]]) -> Sampler:
    """A sampler answering each request with the next list of ``(text, finish_reason)``."""
    it: Iterator[list[tuple[str, str]]] = iter(replies)
    return lambda prompt, params: [Sample(t, finish_reason=f) for t, f in next(it)]


def _idle_worker() -> dict[str, Callable[..., Any]]:
    """``GrpoWorkerExtension``'s RPCs as a float32 worker with no update armed answers them."""
    return {"grpo_model_dtype": lambda: "float32", "grpo_packed_modules": dict,
            "grpo_begin_update": lambda record=False: None,
            "grpo_update_record": lambda: None,
            "grpo_reload_weights": lambda weights_path="": None,
            "grpo_abort_update": lambda: None}


class _Decoding:
    aborted = False


class FakeVLLM:
    """A started fake server (``with FakeVLLM() as fake``, or ``close()``); see the module doc.

    ``url``/``base_url``/``model_name``/``api_key`` are what a ``VLLMServer`` offers, so the
    fake stands where a server is passed. ``api_key`` set: ``/v1`` routes answer 401 without
    ``Authorization: Bearer <api_key>``, as ``vllm serve --api-key`` does.
    """

    def __init__(self, *, model: str = "m", api_key: str | None = None,
                 sampler: Sampler = one_sample_each, decode_s: float = 0.0,
                 burst: int = 1, port: int = 0) -> None:
        self.model_name, self.api_key = model, api_key
        self.sampler, self.decode_s, self.burst = sampler, decode_s, burst
        self.answer: Callable[[Request], tuple[int, Any] | None] = lambda request: None
        self.prompt_logprob: Callable[[list[int], int], float] = lambda seq, i: -1.0
        self.rpc: dict[str, Callable[..., Any]] = _idle_worker()
        self.fail: set[str] = set()
        self.slow: dict[str, float] = {}
        self.requests: list[Request] = []
        self.weight_version = "default"
        self.paused = False
        self.decoding: list[_Decoding] = []
        self._cond = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                route, _, query = self.path.partition("?")
                body = json.loads(raw) if raw else None
                request = Request(self.command, route, query, body, self.headers)
                status, payload = fake._handle(request)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client timed out and left
                    pass

            do_GET = do_POST = _serve

            def log_message(self, *args: object) -> None:
                pass

        # binds as vLLM's server does (SO_REUSEADDR, no SO_REUSEPORT): a taken ``port`` raises
        # "[Errno 98] Address already in use"; 0: a free one
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def calls(self) -> list[str]:
        """The route of every request, in order."""
        return [r.route for r in self.requests]

    @property
    def paths(self) -> list[str]:
        """Every request's path with its query (``/pause?mode=keep``)."""
        return [r.route + (f"?{r.query}" if r.query else "") for r in self.requests]

    @property
    def sampled(self) -> list[dict[str, Any]]:
        """The body of every completions or generate request, in order."""
        return [r.body for r in self.requests if r.route in SAMPLING_ROUTES]

    def close(self) -> None:
        with self._cond:  # no request stays parked on a pause
            self.paused = False
            self._cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeVLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ── the routes ──

    def _handle(self, request: Request) -> tuple[int, Any]:
        self.requests.append(request)
        if request.route in self.slow:
            time.sleep(self.slow[request.route])
        if request.route in self.fail:
            return 500, {"error": f"injected failure of {request.route}"}
        if (answered := self.answer(request)) is not None:
            return answered
        if request.route.startswith("/v1/") and self.api_key is not None and \
                request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {"error": "Unauthorized"}
        route = self._routes().get((request.method, request.route))
        if route is None:
            return 404, {"detail": "Not Found"}
        return route(request)

    def _routes(self) -> dict[tuple[str, str], Callable[[Request], tuple[int, Any]]]:
        return {
            ("GET", "/health"): lambda r: (200, b""),
            ("GET", "/v1/models"): lambda r: (200, {"object": "list", "data": [
                {"id": self.model_name, "object": "model", "owned_by": "vllm"}]}),
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/inference/v1/generate"): self._generate,
            ("POST", "/pause"): self._pause,
            ("POST", "/resume"): self._resume,
            ("GET", "/is_paused"): lambda r: (200, {"is_paused": self.paused}),
            ("POST", "/update_weight_version"): self._set_version,
            ("GET", "/weight_info"): lambda r: (200, {"weight_version": self.weight_version}),
            ("POST", "/reset_prefix_cache"): lambda r: (200, {"success": not self.decoding}),
            ("POST", "/init_weight_transfer_engine"):
                lambda r: (200, {"message": "Weight transfer initialized"}),
            ("POST", "/start_weight_update"): lambda r: (200, {"message": "Weight update started"}),
            ("POST", "/update_weights"): lambda r: (200, {"message": "Weights updated"}),
            ("POST", "/finish_weight_update"): self._finish_update,
            ("POST", "/weight_checker"): lambda r: (200, {"checksums": {}}),
            ("POST", "/collective_rpc"): self._collective_rpc,
        }

    def _metrics(self, request: Request) -> tuple[int, bytes]:
        running = len(self.decoding) if len(self.decoding) >= self.burst else 0
        gauge = (f'vllm:num_requests_running{{engine="0",model_name="{self.model_name}"}} '
                 f"{float(running)}\n")
        return 200, ("# TYPE vllm:num_requests_running gauge\n" + gauge).encode()

    def _pause(self, request: Request) -> tuple[int, Any]:
        mode = parse_qs(request.query).get("mode", ["abort"])[0]  # vLLM's default mode
        if mode not in ("abort", "wait", "keep"):
            return 422, {"detail": f"mode {mode!r}"}
        with self._cond:
            self.paused = True
            if mode == "abort":
                for slot in self.decoding:
                    slot.aborted = True
                self._cond.notify_all()
            if mode == "wait":
                self._cond.wait_for(lambda: not self.decoding)
        return 200, {"status": "paused"}

    def _resume(self, request: Request) -> tuple[int, Any]:
        with self._cond:
            self.paused = False
            self._cond.notify_all()
        return 200, {"status": "resumed"}

    def _set_version(self, request: Request) -> tuple[int, Any]:
        self.weight_version = str(request.body["new_version"])
        return 200, {"success": True, "new_version": self.weight_version}

    def _finish_update(self, request: Request) -> tuple[int, Any]:
        if request.body and request.body.get("weight_version") is not None:
            self.weight_version = str(request.body["weight_version"])
        return 200, {"message": "Weight update finished"}

    def _collective_rpc(self, request: Request) -> tuple[int, Any]:
        method = request.body["method"]
        if method not in self.rpc:
            return 500, {"error": f"AttributeError: the worker has no method {method!r}"}
        return 200, {"results": [self.rpc[method](**(request.body.get("kwargs") or {}))]}

    def _decode(self) -> bool:
        """Wait out a pause, then decode for ``decode_s``; True when ``/pause`` aborted it."""
        slot = _Decoding()
        with self._cond:
            self._cond.wait_for(lambda: not self.paused)
            self.decoding.append(slot)
            self._cond.notify_all()
            self._cond.wait_for(lambda: slot.aborted, timeout=self.decode_s)
            self.decoding.remove(slot)
            self._cond.notify_all()
        return slot.aborted

    def _sample(self, prompt: list[int], params: dict[str, Any]) -> list[Sample]:
        aborted = self._decode()
        samples = self.sampler(prompt, params)
        for s in samples:
            s.logprobs = [-1.0] * len(s.token_ids) if s.logprobs is None else s.logprobs
            s.finish_reason = "abort" if aborted else s.finish_reason
        return samples

    def _completions(self, request: Request) -> tuple[int, Any]:
        body = request.body
        prompts = body["prompt"] if body["prompt"] and isinstance(body["prompt"][0], list) \
            else [body["prompt"]]
        choices: list[dict[str, Any]] = []
        for prompt in prompts:
            for s in self._sample(prompt, body):
                choice = {"index": len(choices), "text": s.text, "finish_reason": s.finish_reason,
                          "stop_reason": None, "token_ids": s.token_ids,
                          "logprobs": {"text_offset": [], "token_logprobs": s.logprobs,
                                       "tokens": [f"token_id:{t}" for t in s.token_ids],
                                       "top_logprobs": []}}
                if body.get("return_token_ids"):
                    choice["prompt_token_ids"] = prompt
                if body.get("prompt_logprobs") is not None:
                    choice["prompt_logprobs"] = [None] + [
                        {str(tok): {"logprob": self.prompt_logprob(prompt, i), "rank": 1}}
                        for i, tok in enumerate(prompt) if i > 0]
                choices.append(choice)
        tokens = sum(len(c["token_ids"]) for c in choices)
        return 200, {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                     "model": body.get("model", self.model_name), "choices": choices,
                     "usage": {"prompt_tokens": sum(map(len, prompts)),
                               "completion_tokens": tokens,
                               "total_tokens": sum(map(len, prompts)) + tokens}}

    def _generate(self, request: Request) -> tuple[int, Any]:
        body, prompt = request.body, request.body["token_ids"]
        samples = self._sample(prompt, body.get("sampling_params") or {})
        mode = body.get("output_mode", "tokens")  # vLLM's default: no detokenizing
        text = mode == "text"
        version = self.weight_version  # every token of a request that ran between two syncs
        choices = [{"index": i, "finish_reason": s.finish_reason, "stop_reason": None,
                    "token_ids": s.token_ids,
                    "weight_versions": [{"version": version, "start": 0,
                                         "end": len(s.token_ids)}],
                    "logprobs": {"content": [
                        {"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                         "top_logprobs": []} if text else
                        {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                        for t, lp in zip(s.token_ids, s.logprobs or [], strict=False)]},
                    **({"text": s.text} if text else {})}
                   for i, s in enumerate(samples)]
        return 200, {"request_id": "fake", "output_mode": mode,
                     "model": body.get("model", self.model_name), "choices": choices,
                     "prompt_token_ids": prompt}
