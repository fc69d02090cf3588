"""The GPU path's configuration, checked on a CPU: what the requests sample, which device the
weight-transfer engine runs on, and that each notebook's server and syncer agree.

No GPU and no server here: CUDA is faked where the code asks for it (``placement``'s probes,
``torch.cuda.device`` and the current-device index vLLM's engines read), and vLLM's own
request and config code turns our request bodies into the sampling it would do.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nbformat
import pytest
import torch

from grpo_nb.llm import placement
from grpo_nb.serving.client import CompletionsClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


# ── sampling: the model folder's generation_config.json changes nothing ──


def _qwen3_defaults(src: str) -> dict[str, Any]:
    """The defaults vLLM's server applies to unset request fields for a Qwen3 folder, by
    vLLM's own ``ModelConfig.get_diff_sampling_param`` (``--generation-config src``)."""
    from realistic_model import QWEN3_SAMPLING
    from transformers import GenerationConfig
    from vllm.config.model import ModelConfig

    folder = GenerationConfig(eos_token_id=[2, 1], pad_token_id=1, **QWEN3_SAMPLING)
    fake = SimpleNamespace(generation_config=src, override_generation_config={},
                           try_get_generation_config=folder.to_diff_dict)
    return ModelConfig.get_diff_sampling_param(fake)


def test_ring_and_rollout_requests_set_every_sampling_field(fake_vllm) -> None:
    """A Qwen3 folder's defaults (top_k 20, top_p 0.95, T 0.6) never reach the sampler: the
    sampler's requests (the ring's and notebook 04's, to /inference/v1/generate) set every
    field a CompletionRequest would take from the folder, and vLLM's GenerateRequest reads them
    as the full distribution at the configured temperature."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.llm.data import Prompt
    from grpo_nb.llm.rollouts import sample_group

    client = CompletionsClient(fake_vllm.base_url, "m")
    asyncio.run(sample_group(client, Prompt("q", [1, 2], "7"), LLMConfig(temperature=0.7).resolve(),
                             lambda: 3))
    sent = fake_vllm.sampled  # the JSON body of each request the client sent
    assert len(sent) == 1  # one request a group
    assert sent[0]["sampling_params"]["n"] == LLMConfig().group_size
    auto = _qwen3_defaults("auto")
    assert auto["top_k"] == 20 and auto["top_p"] == 0.95  # what the folder would impose
    for body in sent:
        fields = body["sampling_params"]
        listed = CompletionRequest(model="m", prompt=[1])._DEFAULT_SAMPLING_PARAMS  # vLLM's
        missing = set(listed) - set(fields)
        assert not missing, f"request leaves {missing} to the model folder"
        params = GenerateRequest(**body).sampling_params
        assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0), params
        assert params.temperature == 0.7
        assert (params.repetition_penalty, params.presence_penalty,
                params.frequency_penalty) == (1.0, 0.0, 0.0)


def test_server_takes_vllms_neutral_defaults_not_the_folders() -> None:
    """Belt and braces: the server starts with ``--generation-config vllm``, under which a
    request that sets only its temperature samples the full distribution too."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from grpo_nb.serving.server import ServerConfig

    cmd = ServerConfig(model="m").command(8000, gpu=False)
    assert cmd[cmd.index("--generation-config") + 1] == "vllm", cmd
    bare = CompletionRequest(model="m", prompt=[1], temperature=0.7)
    params = bare.to_sampling_params(8, _qwen3_defaults("vllm"))
    assert (params.top_k, params.top_p, params.temperature) == (0, 1.0, 0.7)


# ── the weight-transfer engine runs on the trainer's device ──


class _FakeCuda:
    """``torch.cuda.device`` and ``torch.accelerator.current_device_index`` as CUDA has
    them: the current device is per thread, 0 in a thread that never chose one."""

    def __init__(self) -> None:
        self.local = threading.local()

    def current(self) -> int:
        return getattr(self.local, "index", 0)

    @contextlib.contextmanager
    def device(self, dev: Any) -> Any:
        before = self.current()
        self.local.index = torch.device(dev).index
        try:
            yield
        finally:
            self.local.index = before


class _FakeModel:
    """What the syncer reads of a model: its parameters' device (a GPU we do not have)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)

    def parameters(self) -> Any:
        return iter([SimpleNamespace(device=self.device, numel=lambda: 1,
                                     element_size=lambda: 4)])


class _QuietClient:
    """The server's control routes, answered at once (no server): every worker RPC answers
    ``["float32"]`` (what ``grpo_model_dtype`` would say), every other route nothing."""

    round_trips = 0

    def collective_rpc(self, *args: Any, **kwargs: Any) -> list[str]:
        return ["float32"]

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_engine_is_built_and_driven_on_the_trainers_device(monkeypatch, transport) -> None:
    """Trainer on cuda:1 (server on cuda:0): vLLM builds NCCL's communicator / names IPC's
    GPU from the current device, so connect, every sync and close must run under cuda:1 —
    from fresh threads (as ``asyncio.to_thread`` runs the ring's syncs), whose current
    device is 0."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from grpo_nb.weight_sync import WeightSyncConfig, WeightSyncer

    cuda = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "device", cuda.device)
    monkeypatch.setattr(torch.accelerator, "current_device_index", cuda.current)
    seen: dict[str, list[int]] = {"init": [], "send": [], "shutdown": []}

    class Engine:
        def send_weights(self) -> None:
            seen["send"].append(torch.accelerator.current_device_index())

        def shutdown(self) -> None:
            seen["shutdown"].append(torch.accelerator.current_device_index())

    def trainer_init(info: Any, *, client: Any, source: Any) -> Engine:
        seen["init"].append(torch.accelerator.current_device_index())
        return Engine()

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)
    syncer = WeightSyncer("http://127.0.0.1:9", _FakeModel("cuda:1"),
                          WeightSyncConfig(transport=transport, verify=False))
    syncer.client = _QuietClient()

    def in_a_fresh_thread(fn: Any, *args: Any) -> None:
        errors: list[BaseException] = []
        t = threading.Thread(target=lambda: _capture(errors, fn, *args))
        t.start()
        t.join(30)
        assert not errors, errors

    in_a_fresh_thread(syncer.connect)
    for version in (1, 2):
        asyncio.run(asyncio.to_thread(syncer.sync, version, verify=False))
        in_a_fresh_thread(lambda v=version + 10: syncer.sync(v, verify=False))
    in_a_fresh_thread(syncer.close)
    assert seen == {"init": [1], "send": [1, 1, 1, 1], "shutdown": [1]}, seen
    assert cuda.current() == 0  # the caller's own device is left as it was


def _capture(errors: list[BaseException], fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except BaseException as err:  # reported by the joining thread
        errors.append(err)


@pytest.mark.parametrize(("device", "transport"), [("cpu", "nccl"), ("cpu", "ipc"),
                                                   ("cuda:0", "gloo")])
def test_a_model_on_the_wrong_device_for_the_transport_is_refused(device, transport) -> None:
    """The notebook bug in one line: a CPU model with a CUDA transport (or the reverse)
    fails at connect with the reason, before any request reaches the server."""
    from grpo_nb.weight_sync import WeightSyncConfig, WeightSyncer, WeightSyncError

    syncer = WeightSyncer("http://127.0.0.1:9", _FakeModel(device),
                          WeightSyncConfig(transport=transport))
    syncer.client = None  # any call to the server would raise AttributeError
    with pytest.raises(WeightSyncError, match=rf"transport='{transport}' cannot send"):
        syncer.connect()


@pytest.mark.parametrize(("mask", "server"), [(None, "0"), ("2,3", "2"), (" 5 , 1", "5"),
                                              ("GPU-8c1f,GPU-77aa", "GPU-8c1f")])
def test_server_gpu_is_the_first_of_the_inherited_mask(monkeypatch, mask, server) -> None:
    """With a GPU each, the server takes the first GPU this process sees and the trainer the
    last: under a scheduler's mask ``2,3`` that is physical GPU 2, not 0 (someone else's)."""
    from grpo_nb.llm.config import LLMConfig

    monkeypatch.setattr(placement, "cuda_available", lambda: True)
    monkeypatch.setattr(placement, "gpu_count", lambda: 2)
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    cfg = LLMConfig()
    scfg = placement.server_config("Qwen/Qwen3-0.6B", cfg)
    assert scfg.environment("id", gpu=True)["CUDA_VISIBLE_DEVICES"] == server
    assert placement.trainer_device(cfg) == "cuda:1"


# ── notebooks: what they configure, driven through placement with CUDA faked ──


def _cell(notebook: str, cell_id: str) -> str:
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    (cell,) = [c for c in nb.cells if c.get("id") == cell_id]
    return "\n".join(line for line in cell.source.splitlines() if not line.startswith("%"))


def _code(notebook: str) -> list[str]:
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    monkeypatch.setattr(placement, "cuda_available", lambda: gpus > 0)
    monkeypatch.setattr(placement, "gpu_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_notebook_04_serves_the_tiny_model_in_float32_on_any_device(monkeypatch, gpus) -> None:
    """04 compares the server's log-probs with the float32 model's to 1e-4: its server runs
    float32 on a GPU too (dtype "auto" would serve the float32 folder in 16 bits), with a
    KV cache in bytes (section 8 starts a Qwen server on the same GPU)."""
    from grpo_nb.config import preset
    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.serving.server import ServerConfig

    _fake_gpus(monkeypatch, gpus)
    tree = ast.parse(_cell("04_vllm_rollouts.ipynb", "5390bb2f"))
    (assign,) = [s for s in tree.body if isinstance(s, ast.Assign)
                 and [t.id for t in s.targets if isinstance(t, ast.Name)] == ["server_cfg"]]
    ns: dict[str, Any] = {"dataclasses": dataclasses, "preset": preset, "LLMConfig": LLMConfig,
                          "ServerConfig": ServerConfig, "model_dir": Path("/m")}
    exec(compile(ast.Module([assign], []), "04", "exec"), ns)
    cmd = ns["server_cfg"].command(8000, gpu=gpus > 0)
    # 05's server context (placement): vLLM's compile cache key holds it, so 05 reuses 04's
    ring = placement.server_config("/m", preset(LLMConfig).replace(dtype="float32"))
    assert cmd[cmd.index("--max-model-len") + 1] == str(ring.max_model_len), cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32", cmd
    assert int(cmd[cmd.index("--kv-cache-memory-bytes") + 1]) <= 64 << 20


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_notebook_05_server_engine_and_syncer_transport_agree(monkeypatch, gpus) -> None:
    """05's setup cell, run with 0, 1 or 2 GPUs faked: the engine the server is started with
    (``server_for(model_dir, cfg)`` → placement) is the transport of the ``sync_cfg``
    every WeightSyncer of the notebook gets, the trainer model sits on the device that
    transport sends from, and both sides run float32 (the notebook's 1e-3 checks)."""
    _fake_gpus(monkeypatch, gpus)
    ns: dict[str, Any] = {"USE_RECORDED": False}  # set by the cell before
    exec(compile(_cell("05_async_grpo.ipynb", "e3c1ad1a"), "05", "exec"), ns)
    cfg, sync_cfg, device = ns["cfg"], ns["sync_cfg"], ns["device"]
    server = placement.server_config("/m", cfg)
    assert server.weight_transfer_config == {"backend": sync_cfg.transport}
    assert sync_cfg.transport == {0: "gloo", 1: "ipc", 2: "nccl"}[gpus]
    assert device == {0: "cpu", 1: "cuda:0", 2: "cuda:1"}[gpus]
    assert server.dtype == placement.dtype_of(cfg) == "float32"
    assert (sync_cfg.pause_mode == "none") == (gpus == 0)  # none: CPU engines only
    # Every syncer of the notebook takes sync_cfg (or a copy with other pause/verify), and
    # every model it syncs is loaded onto `device`.
    calls = [n for src in _code("05_async_grpo.ipynb") for n in ast.walk(ast.parse(
        "\n".join(x for x in src.splitlines() if not x.startswith("%"))))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "WeightSyncer"]
    assert calls
    for call in calls:
        arg = call.args[2]
        if isinstance(arg, ast.Call):  # replace(sync_cfg, pause_mode=..., verify=...)
            assert getattr(arg.func, "id", None) == "replace", ast.unparse(call)
            arg = arg.args[0]
        assert getattr(arg, "id", None) == "sync_cfg", ast.unparse(call)
    for src in _code("05_async_grpo.ipynb"):
        if "model, tok = load_policy(" in src:
            assert "model, tok = load_policy(model_dir, device)" in src, src


def test_float32_server_on_cuda_runs_ieee_attention() -> None:
    """vLLM's fp32 attention on CUDA is Triton's unified attention, whose tl.dot takes
    TRITON_F32_DEFAULT (else TF32): an fp32 server on a GPU gets "ieee"; bf16 and CPU do not."""
    from grpo_nb.serving.server import ServerConfig

    assert ServerConfig(model="m", dtype="float32").environment("i", gpu=True)[
        "TRITON_F32_DEFAULT"] == "ieee"
    assert "TRITON_F32_DEFAULT" not in ServerConfig(model="m", dtype="bfloat16").environment(
        "i", gpu=True)
    assert "TRITON_F32_DEFAULT" not in ServerConfig(model="m", dtype="float32").environment(
        "i", gpu=False)
