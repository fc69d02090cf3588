"""Serving: config validation (no server), then one real vLLM-CPU server for the session."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fake_vllm import FakeVLLM
from keyed_checks import status as _status

from grpo_nb.serving import server as serving
from grpo_nb.serving.client import ClientConfig, CompletionError, CompletionsClient
from grpo_nb.serving.processes import marked_processes, wait_exit
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


def test_dev_mode_server_is_loopback_only_key_or_not():
    """Weight routes are not guarded by vLLM's key: a dev-mode server never leaves loopback."""
    with pytest.raises(ValueError, match="host='0.0.0.0'.*dev_mode.*only /v1"):
        ServerConfig(model="m", host="0.0.0.0", api_key="secret")
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(model="m", host="0.0.0.0", dev_mode=False)
    assert ServerConfig(model="m", host="0.0.0.0", dev_mode=False, api_key="k").host == "0.0.0.0"
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        ServerConfig(model="m", host="10.0.0.1", dev_mode=False, api_key="k",
                     env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    with pytest.raises(ValueError, match="extra_args has --host"):
        ServerConfig(model="m", extra_args=["--host=0.0.0.0"])
    for host in ("::1", "localhost", "127.0.0.2"):
        assert ServerConfig(model="m", host=host).dev_mode
    # Fields set after construction (as WeightSyncConfig.server_settings does) are checked at
    # start, before anything is spawned.
    cfg = ServerConfig(model="m", host="127.0.0.1", api_key="k")
    cfg.host = "192.168.1.5"
    server = VLLMServer(cfg)
    with pytest.raises(ValueError, match="dev_mode"):
        server.start(progress=False)
    assert server.proc is None and server not in serving._LIVE


def test_api_key_travels_by_environment_never_argv(tmp_path, monkeypatch):
    cfg = ServerConfig(model="m", api_key="s3cret-key")
    assert not any("s3cret" in a for a in cfg.command(8000, gpu=False))
    assert cfg.environment("abc", gpu=False)["VLLM_API_KEY"] == "s3cret-key"
    assert "s3cret" not in repr(cfg) and "s3cret" not in repr(ClientConfig(api_key="s3cret"))
    with pytest.raises(ValueError, match="extra_args has --api-key"):
        ServerConfig(model="m", extra_args=["--api-key", "x"])
    with pytest.raises(ValueError, match="env has VLLM_API_KEY"):
        ServerConfig(model="m", env={"VLLM_API_KEY": "x"})
    # An unkeyed config does not silently pass on a key from our environment to the server.
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert ServerConfig(model="m").api_key == "from-env" == ClientConfig().api_key
    monkeypatch.delenv("VLLM_API_KEY")
    assert "VLLM_API_KEY" not in ServerConfig(model="m").environment("abc", gpu=False)
    server = VLLMServer(ServerConfig(model="m", api_key="s3cret-key"))
    server.log_path = tmp_path / "server.log"
    server.log_path.write_text("starting\nheader Bearer s3cret-key seen\n")
    assert "s3cret" not in server.log_tail() and "Bearer ***" in server.log_tail()


def test_free_port_refuses_to_bind_beyond_loopback():
    from grpo_nb.serving.net import free_port as net_free_port

    assert serving.free_port is net_free_port
    with pytest.raises(ValueError, match="loopback"):
        net_free_port("0.0.0.0")
    assert 0 < net_free_port() < 65536 and net_free_port("::1") > 0


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
                await c.generate([1, 2, 3])
            return c.stats, info.value

    stats, err = asyncio.run(go())
    assert err.kind == "connection_errors"
    assert (stats.requests, stats.failed, stats.retries, stats.connection_errors) == (1, 1, 2, 1)


def _content(*logprobs: float) -> dict:
    """A generate choice's ``logprobs``: one entry per token."""
    return {"content": [{"token": "t", "logprob": lp} for lp in logprobs]}


async def _with_stub_server(handler, body):
    """Run ``body(client)`` against the fake server, on which ``handler(request_json,
    headers)`` answers each POST with ``(status, json_body)``: vLLM does not answer 5xx or
    token-less choices on demand, so these failure paths are exercised against the fake."""
    with FakeVLLM() as fake:
        fake.answer = lambda r: handler(r.body, r.headers) if r.method == "POST" else None
        async with CompletionsClient(fake.base_url, "m",
                                     ClientConfig(retries=1, backoff_s=0.01)) as client:
            return await body(client)


def test_the_fake_server_answers_in_vllms_own_shapes():
    """tests/fake_vllm.py's answers parse as vLLM 0.32's response models, and the package's
    clients read them: so a test against the fake tests what a real server would send."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateTextResponse,
        GenerateTokensResponse,
    )

    from grpo_nb.serving.control import VLLMControlClient

    with FakeVLLM() as fake:
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 1, "n": 2, "logprobs": 1,
                "return_token_ids": True, "prompt_logprobs": 0}
        CompletionResponse.model_validate(httpx.post(f"{fake.base_url}/completions",
                                                     json=body, timeout=10).json())
        for mode, model in (("text", GenerateTextResponse), ("tokens", GenerateTokensResponse)):
            reply = httpx.post(f"{fake.url}/inference/v1/generate", timeout=10, json={
                "model": "m", "token_ids": [1], "output_mode": mode,
                "sampling_params": {"n": 2, "logprobs": 0}}).json()
            assert model.model_validate(reply).choices[0].weight_versions[0].version == "default"
        control = VLLMControlClient(fake.url, timeout=10)
        control.set_weight_version("3")
        control.pause("abort")
        assert (control.weight_version(), control.is_paused()) == ("3", True)
        control.resume()
        assert control.wait_running(0, timeout=1) and control.model_name() == "m"
        assert control.prompt_logprobs([[4, 5, 6]]) == [[-1.0, -1.0]]
        assert control.collective_rpc("grpo_model_dtype") == ["float32"]

        async def sample():
            async with CompletionsClient.for_server(fake) as client:
                return await client.generate([1], n=2)

        generated = asyncio.run(sample())
        assert [c.versions for c in generated] == [["3"], ["3"]]
        assert generated[0].token_ids == [5] and generated[0].logprobs == [-1.0]


def test_http_5xx_is_raised_and_counted_not_retried():
    calls = []

    def handler(request, headers):
        calls.append(request)
        return 503, "engine dead"

    async def body(client):
        with pytest.raises(CompletionError, match="HTTP 503.*engine dead") as info:
            await client.generate([1, 2], max_tokens=3)
        return info.value, client.stats

    err, stats = asyncio.run(_with_stub_server(handler, body))
    assert err.kind == "http_5xx" and err.status == 503
    assert (stats.http_5xx, stats.failed, stats.retries, len(calls)) == (1, 1, 0, 1)
    assert calls[0]["token_ids"] == [1, 2] and calls[0]["output_mode"] == "text"


def test_empty_and_misaligned_completions_are_counted():
    answers = iter([
        {"choices": [{"text": "", "token_ids": [], "logprobs": {"content": []},
                      "finish_reason": "length"}]},
        {"choices": [{"text": "7", "token_ids": [9, 1], "logprobs": _content(-1.0),
                      "finish_reason": "stop"}]},
        {"choices": []},
    ])

    def handler(request, headers):
        return 200, next(answers)

    async def body(client):
        kinds = []
        for _ in range(3):
            with pytest.raises(CompletionError) as info:
                await client.generate([1], max_tokens=3)
            kinds.append(info.value.kind)
        return kinds, client.stats

    kinds, stats = asyncio.run(_with_stub_server(handler, body))
    assert kinds == ["empty", "http_5xx", "empty"]
    assert (stats.requests, stats.failed, stats.empty, stats.ok) == (3, 3, 2, 0)


def test_aborted_choices_are_returned_not_raised():
    """/pause?mode=abort ends requests with finish_reason="abort", sometimes with no token."""

    def handler(request, headers):
        return 200, {"choices": [
            {"text": "", "token_ids": [], "logprobs": None, "finish_reason": "abort"},
            {"text": "1", "token_ids": [5, 6], "logprobs": _content(-0.5, -0.7),
             "finish_reason": "abort"},
            {"text": "12", "token_ids": [5, 7], "logprobs": _content(-0.1, -0.2),
             "finish_reason": "stop"}]}

    async def body(client):
        return await client.generate([1], max_tokens=4, n=3), client.stats

    outs, stats = asyncio.run(_with_stub_server(handler, body))
    assert [o.finish_reason for o in outs] == ["abort", "abort", "stop"]
    assert (outs[0].token_ids, outs[0].logprobs) == ([], [])
    assert (outs[1].token_ids, outs[1].logprobs) == ([5, 6], [-0.5, -0.7])
    assert (stats.aborted, stats.failed, stats.empty, stats.ok) == (2, 0, 0, 1)


def test_a_4xx_fails_only_its_own_request_with_its_status():
    def handler(request, headers):
        prompt = request["token_ids"]
        if prompt == [0]:
            return 400, {"error": "prompt too long"}
        time.sleep(0.2)  # the others are still in flight when the 400 comes back
        return 200, {"choices": [{"text": "x", "token_ids": prompt, "finish_reason": "length",
                                  "logprobs": _content(-1.0)}]}

    async def body(client):
        results = await asyncio.gather(*[client.generate([i]) for i in range(4)],
                                       return_exceptions=True)
        return results, client.stats

    results, stats = asyncio.run(_with_stub_server(handler, body))
    err = results[0]
    assert isinstance(err, CompletionError) and (err.kind, err.status) == ("http_4xx", 400)
    assert [r[0].token_ids for r in results[1:]] == [[1], [2], [3]]
    assert (stats.requests, stats.ok, stats.failed, stats.http_4xx, stats.retries) == (4, 3, 1, 1, 0)


def test_every_request_carries_the_api_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    seen = []

    def handler(request, headers):
        seen.append(headers.get("Authorization"))
        return 200, {"choices": [{"text": "x", "token_ids": [1], "finish_reason": "stop",
                                  "logprobs": _content(-1.0)}]}

    async def body(client):
        await client.generate([1])
        server = type("S", (), {"base_url": client.base_url, "model_name": "m",
                                "api_key": "from-server"})()
        async with CompletionsClient.for_server(server) as keyed:
            await keyed.generate([1])
        monkeypatch.setenv("VLLM_API_KEY", "from-env")
        async with CompletionsClient(client.base_url, "m", ClientConfig(max_in_flight=1)) as c:
            await c.generate([1])
        async with CompletionsClient(client.base_url, "m", ClientConfig(api_key="cfg")) as c:
            await c.generate([1])

    asyncio.run(_with_stub_server(handler, body))
    assert seen == [None, "Bearer from-server", "Bearer from-env", "Bearer cfg"]


def test_slow_server_times_out_and_is_counted():
    def handler(request, headers):
        time.sleep(1.5)
        return 200, {}

    async def body(client):
        client.cfg.timeout_s = 0.3
        with pytest.raises(CompletionError, match="timeout|timed out|within") as info:
            await client.generate([1])
        return info.value, client.stats

    err, stats = asyncio.run(_with_stub_server(handler, body))
    assert err.kind == "timeouts" and stats.timeouts == 1 and stats.failed == 1


def test_attach_to_nothing_is_a_clear_error():
    with pytest.raises(ConnectionError, match="no vLLM server reachable"):
        VLLMServer.attach(f"http://127.0.0.1:{free_port()}", timeout=2)


def test_bad_client_config_names_the_field():
    with pytest.raises(ValueError, match="max_in_flight"):
        ClientConfig(max_in_flight=0)


# ---------------------------------------------------------------- process safety (fake vLLM)

# A stand-in for vLLM's process tree: a parent that spawns a child, both sleeping.
FAKE_TREE = ("import subprocess, sys, time; "
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
             "time.sleep(300)")


@pytest.fixture
def fake_server(monkeypatch, tmp_path):
    """``make(healthy=..., **cfg)``: a VLLMServer whose command is FAKE_TREE (no vLLM)."""
    def command(self, port, gpu):
        return [sys.executable, "-c", self.env.get("FAKE", FAKE_TREE)]

    monkeypatch.setattr(ServerConfig, "command", command)
    # A registry of this test's own: stop_all() here must not stop the session's real server.
    monkeypatch.setattr(serving, "_LIVE", set())

    def make(healthy: bool = True, **kw):
        monkeypatch.setattr(VLLMServer, "healthy", lambda self: healthy)
        return VLLMServer(ServerConfig(model="fake", log_dir=tmp_path, **kw))

    yield make
    serving.stop_all()


def _wait_for(predicate, timeout: float) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_a_dropped_server_is_still_registered_and_stopped_at_exit(fake_server):
    server = fake_server().start(progress=False)
    sid = server.server_id
    _wait_for(lambda: len(marked_processes([sid])) == 2, 20)
    del server  # what re-running `server = VLLMServer(cfg).start()` in a notebook does
    gc.collect()
    assert any(s.server_id == sid for s in serving._LIVE)
    serving.stop_all()  # the atexit hook
    assert not marked_processes([sid])


def test_same_name_replaces_the_previous_server(fake_server):
    first = fake_server(name="nb04").start(progress=False)
    second = fake_server(name="nb04").start(progress=False)
    assert not first.is_running() and not first.pids() and second.is_running()
    second.stop()
    assert not second.pids() and second not in serving._LIVE


# The tests' fake vLLM in a process of its own, on the port it is given (binding it as vLLM does).
FAKE_VLLM_ON_PORT = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
                     "from fake_vllm import FakeVLLM; FakeVLLM(port=int(sys.argv[2])); "
                     "time.sleep(300)")
HEALTHY = VLLMServer.healthy  # the real check; fake_server() replaces it


@pytest.fixture
def port_taken_first(fake_server, fake_vllm, monkeypatch):
    """``make(**cfg)``: a server answering /health like vLLM, whose first picked port is taken
    by another (the fake vLLM, which answers /health too); yields (make, the taken port)."""
    picked: list[int] = []

    def pick(host):
        picked.append(fake_vllm.port if not picked else free_port(host))
        return picked[-1]

    def make(**kw):
        server = fake_server(**kw)
        monkeypatch.setattr(serving, "free_port", pick)
        monkeypatch.setattr(ServerConfig, "command", lambda cfg, port, gpu: [
            sys.executable, "-c", FAKE_VLLM_ON_PORT, str(Path(__file__).parent), str(port)])
        monkeypatch.setattr(VLLMServer, "healthy", HEALTHY)
        return server

    return make, fake_vllm.port


def test_a_picked_port_taken_before_vllm_binds_it_starts_again_on_another(port_taken_first,
                                                                          tmp_path):
    make, taken = port_taken_first
    server = make().start(progress=False)
    assert server.port != taken and server.is_running() and server.healthy()
    logs = {int(p.stem.rsplit("-", 1)[1]): p.read_text() for p in tmp_path.glob("server-*.log")}
    assert sorted(logs) == sorted([taken, server.port])
    assert serving.PORT_TAKEN in logs[taken] and serving.PORT_TAKEN not in logs[server.port]
    assert len(marked_processes([server.server_id])) == 1  # the failed start left nothing
    server.stop()
    assert not server.pids()


def test_a_configured_port_in_use_fails_once_and_says_so(port_taken_first, tmp_path):
    make, taken = port_taken_first
    server = make(port=taken)
    with pytest.raises(ServerStartError, match=f"port {taken} is in use: ServerConfig.port=0"):
        server.start(progress=False)
    assert len(list(tmp_path.glob("server-*.log"))) == 1 and not server.pids()


def test_start_progress_into_a_file_is_not_a_line_every_tick(fake_server, monkeypatch, capsys):
    """Into a pipe or a log (here pytest's capture: not a terminal) the start's ticker writes
    a line each PLAIN_TICK_S, not each 0.5 s: an unread pipe must not fill during a start."""
    server = fake_server()
    ready_at = time.monotonic() + 4
    monkeypatch.setattr(VLLMServer, "healthy", lambda self: time.monotonic() > ready_at)
    server.start(progress=True)
    server.stop()
    err = capsys.readouterr().err
    writes = err.count(f"vLLM :{server.port}")
    assert 1 <= writes <= 3, repr(err)  # shown, its first status, cleared; not 8 ticks


def test_start_progress_in_a_notebook_redraws_every_tick(fake_server, monkeypatch):
    """In a notebook (tqdm.auto's bar there: a tqdm.notebook widget, whose stderr is no
    terminal) the start's status still updates each 0.5 s."""
    import tqdm.auto
    from tqdm.asyncio import tqdm_asyncio
    from tqdm.notebook import tqdm_notebook

    statuses: list[str] = []

    class NotebookBar(tqdm_notebook, tqdm_asyncio):  # what tqdm.auto builds in a kernel
        def set_postfix_str(self, s="", refresh=True):
            statuses.append(s)
            super().set_postfix_str(s, refresh)

    monkeypatch.setattr(tqdm.auto, "tqdm", NotebookBar)
    server = fake_server()
    ready_at = time.monotonic() + 3
    monkeypatch.setattr(VLLMServer, "healthy", lambda self: time.monotonic() > ready_at)
    server.start(progress=True)
    server.stop()
    assert len(statuses) >= 4, statuses


def test_cancelled_start_async_stops_the_server(fake_server):
    server = fake_server(healthy=False)

    async def go():
        task = asyncio.create_task(server.start_async())
        while not server.pids():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert not server.pids() and not server.is_running() and server not in serving._LIVE
    assert server.watchdog.poll() is not None


def test_stop_ends_a_start_running_in_a_thread(fake_server):
    """``await asyncio.to_thread(server.start)`` + ``server.stop()`` on interrupt."""
    import threading

    server, errors = fake_server(healthy=False), []
    thread = threading.Thread(target=lambda: _record(errors, server.start, progress=False))
    thread.start()
    _wait_for(lambda: server.pids(), 20)
    server.stop()
    thread.join(timeout=20)
    assert not thread.is_alive() and not server.pids()
    assert isinstance(errors[0], ServerStartError) and "stopped while starting" in str(errors[0])
    never = fake_server()
    never.stop()  # stopped before its start ran: the start must not spawn anything
    with pytest.raises(RuntimeError, match="already started or stopped"):
        never.start(progress=False)
    assert never.proc is None


def _record(errors, fn, **kw):
    try:
        fn(**kw)
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        errors.append(err)


def test_wait_exit_wakes_on_the_exit_and_leaves_the_code_to_popen(fake_server):
    """Without polling or reaping: ``proc.returncode`` still reads the server's exit code."""
    server = fake_server(env={"FAKE": "import time; time.sleep(1.0); raise SystemExit(3)"})
    server.start(progress=False)

    async def go():
        t0 = time.monotonic()
        await asyncio.wait_for(wait_exit(server.proc.pid), 30)
        return time.monotonic() - t0

    assert 0.5 < asyncio.run(go()) < 10 and server.proc.poll() == 3
    asyncio.run(asyncio.wait_for(wait_exit(server.proc.pid), 1))  # reaped: returns at once
    server.stop()


OWNER_SCRIPT = """
import json, sys, time
from grpo_nb.serving import server as s
s.ServerConfig.command = lambda self, port, gpu: [sys.executable, "-c", sys.argv[2]]
s.VLLMServer.healthy = lambda self: True
srv = s.VLLMServer(s.ServerConfig(model="fake", log_dir=sys.argv[1])).start(progress=False)
while len(srv.pids()) < 2:
    time.sleep(0.1)
print(json.dumps({"id": srv.server_id, "pids": srv.pids()}), flush=True)
time.sleep(600)
"""


def _sigkill_owner_and_time_cleanup(script: str, args: list[str], check=None,
                                    env: dict[str, str] | None = None, timeout: float = 10.0):
    """Run ``script`` (it starts a server and prints its id as JSON), run ``check(info)``,
    SIGKILL the script's process, and return how long the server's processes took to go."""
    import psutil

    owner = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                             text=True, env=env)
    info: dict = {}
    try:
        info = json.loads(owner.stdout.readline() or "{}")
        procs = marked_processes([info["id"]])
        assert len(procs) >= 2, info
        if check is not None:
            check(info, procs)
        owner.kill()
        owner.wait()
        seconds = _wait_for(lambda: not any(p.is_running() and p.status() != "zombie"
                                            for p in procs), timeout)
        return info, seconds
    finally:
        owner.kill()
        owner.wait()
        for p in marked_processes([info["id"]]) if info else []:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_a_sigkilled_owner_takes_its_server_tree_down(tmp_path):
    info, seconds = _sigkill_owner_and_time_cleanup(OWNER_SCRIPT, [str(tmp_path), FAKE_TREE])
    print(f"fake server tree gone {seconds:.1f} s after its owner was SIGKILLed")


def test_doctor_lists_and_reaps_servers_whose_owner_is_gone():
    import psutil

    from grpo_nb.course.doctor import orphan_section
    from grpo_nb.serving.processes import MARKER_ENV, OWNER_ENV, find_orphans, owned_by, reap

    # The owner died but was not reaped yet (a zombie): like a SIGKILLed kernel whose parent
    # has not called wait(). Its pid still exists; it must count as gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    _wait_for(lambda: psutil.Process(dead.pid).status() == psutil.STATUS_ZOMBIE, 20)
    procs = {}
    for tag, owner in (("orphan", dead.pid), ("owned", os.getpid())):
        env = {**os.environ, MARKER_ENV: f"test-{tag}-{os.getpid()}", OWNER_ENV: str(owner)}
        procs[tag] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                       "--port", "1234"], env=env)
    try:
        _wait_for(lambda: any(o.server_id.startswith("test-orphan") for o in find_orphans()), 10)
        found = [o for o in find_orphans() if o.server_id.startswith("test-")]
        assert [(o.owner_pid, o.pids, o.port) for o in found] == [
            (dead.pid, [procs["orphan"].pid], "1234")]
        assert f"server {found[0].server_id} port 1234" in orphan_section(reap=False)
        mine = [p.pid for p in owned_by(os.getpid())]
        assert procs["owned"].pid in mine and procs["orphan"].pid not in mine
        # `doctor --reap` ends every orphan of this user; the test reaps only its own.
        assert reap(found) == [procs["orphan"].pid]
        assert procs["orphan"].wait(timeout=15) is not None
        assert procs["owned"].poll() is None  # its owner (this test) is alive: left alone
    finally:
        for p in [*procs.values(), dead]:
            p.kill()
            p.wait()


# ---------------------------------------------------------------- a real server

@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_server_health_models_and_attach(vllm_server):
    assert vllm_server.healthy()
    assert vllm_server.startup_seconds is not None and vllm_server.pids()
    models = httpx.get(f"{vllm_server.base_url}/models", timeout=10).json()
    assert models["data"][0]["id"] == vllm_server.model_name
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
            outs = await asyncio.gather(*[c.generate(prompt, max_tokens=6, temperature=1.0,
                                                     seed=i) for i in range(8)])
            greedy = [(await c.generate(prompt, max_tokens=6, temperature=0.0))[0]
                      for _ in range(2)]
            return [o[0] for o in outs], greedy, c.stats

    outs, greedy, stats = asyncio.run(go())
    for o in outs:
        assert 1 <= len(o.token_ids) <= 6 and len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 0.0 for lp in o.logprobs)
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    assert greedy[0].token_ids == greedy[1].token_ids
    assert (stats.requests, stats.ok, stats.failed) == (10, 10, 0)


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_bad_requests_are_counted_failures(vllm_server):
    """4xx (too long a prompt, unknown model, bad parameter) and an empty completion."""

    async def go():
        async with CompletionsClient.for_server(vllm_server) as c:
            with pytest.raises(CompletionError) as too_long:
                await c.generate([3] * (vllm_server.cfg.max_model_len + 10), max_tokens=4)
            with pytest.raises(CompletionError) as bad_param:
                await c.generate([3, 4], max_tokens=4, temperature=-1.0)
            # eos forced first: a completion with one token and no text is kept, but counted.
            eos_first = await c.generate([3, 4], max_tokens=4, logit_bias={"1": 100.0})
            stats = c.stats
        async with CompletionsClient(vllm_server.base_url, "no-such-model") as other:
            with pytest.raises(CompletionError) as wrong_model:
                await other.generate([3, 4], max_tokens=2)
        return too_long.value, bad_param.value, eos_first, stats, wrong_model.value

    too_long, bad_param, eos_first, stats, wrong_model = asyncio.run(go())
    for err in (too_long, bad_param, wrong_model):
        assert err.kind == "http_4xx" and 400 <= err.status < 500, err
    assert "maximum" in str(too_long).lower() or "length" in str(too_long).lower()
    assert eos_first[0].text == "" and eos_first[0].token_ids == [1]
    assert (stats.http_4xx, stats.failed, stats.empty_text, stats.ok) == (2, 2, 1, 1)
    assert len(stats.errors) == 2


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_pause_abort_returns_aborted_choices(vllm_server):
    """Requests in flight at ``/pause?mode=abort`` come back as finish_reason="abort"
    Completions (never raised); after ``/resume`` the server generates again."""
    url = vllm_server.url

    async def go():
        async with CompletionsClient.for_server(vllm_server) as c:
            before = vllm_server_tokens(url)
            tasks = [asyncio.create_task(c.generate([3, 4 + i], max_tokens=200, n=2,
                                                    ignore_eos=True)) for i in range(3)]
            while vllm_server_tokens(url) == before:  # pause once tokens are flowing
                await asyncio.sleep(0.05)
            try:
                assert await asyncio.to_thread(_status, f"{url}/pause?mode=abort", {}) == 200
                outs = await asyncio.gather(*tasks)
            finally:
                assert await asyncio.to_thread(_status, f"{url}/resume", {}) == 200
            after = await c.generate([3, 4], max_tokens=2, ignore_eos=True)  # EOS may come first
            return [o for out in outs for o in out], after, c.stats

    outs, after, stats = asyncio.run(go())
    assert {o.finish_reason for o in outs} == {"abort"} and len(outs) == 6
    assert all(len(o.token_ids) < 200 and len(o.logprobs) == len(o.token_ids) for o in outs)
    assert (stats.aborted, stats.failed) == (6, 0) and after[0].finish_reason == "length"
    assert httpx.get(f"{url}/is_paused", timeout=10).json()["is_paused"] is False


def vllm_server_tokens(url: str) -> float:
    """Generation tokens the server has produced so far (Prometheus ``/metrics``)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def test_eager_is_a_field_not_an_extra_arg(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_NB_SERVER_EAGER", raising=False)
    cfg = ServerConfig(model="m", log_dir=tmp_path)
    assert "--enforce-eager" not in cfg.command(8000, gpu=False)  # compiled by default
    cfg.eager = True
    assert "--enforce-eager" in cfg.command(8000, gpu=False)
    with pytest.raises(ValueError, match="ServerConfig.eager"):
        ServerConfig(model="m", extra_args=["--enforce-eager"])


def test_eager_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("GRPO_NB_SERVER_EAGER", "1")
    assert ServerConfig(model="m").eager is True
    monkeypatch.setenv("GRPO_NB_SERVER_EAGER", "0")
    assert ServerConfig(model="m").eager is False
