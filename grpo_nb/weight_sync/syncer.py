"""Push the trainer's weights into a running vLLM server, and prove they arrived.

One :class:`WeightSyncer` per (trainer model, server). Each :meth:`WeightSyncer.sync` runs
vLLM's own weight-update flow and sets a new weight version on the server::

    sync(version)
      ├─ /collective_rpc grpo_abort_update  (only after a failed sync: close its update)
      ├─ /pause?mode=keep|wait|abort   (no token from half-new weights; "none": see below)
      ├─ transport, in the send dtype (the server's: an fp32 trainer sends bf16 to a bf16 server)
      │    gloo   : vLLM WeightTransferTrainerFactory → our gloo engine (start + update +
      │             finish in one /collective_rpc, overlapped with our broadcasts)
      │    nccl   : the same factory → vLLM's NCCL engine (trainer and server on 2 GPUs)
      │    ipc    : the same factory → vLLM's CUDA-IPC engine (trainer and server share a GPU)
      │    reload : save safetensors → /collective_rpc grpo_reload_weights(weights_path=DIR)
      │    (verify: the worker digests every tensor its load_weights receives; gloo says so
      │     in its update RPC, the others in one /collective_rpc grpo_begin_update first)
      ├─ weight version := str(version)
      ├─ /resume                          (after any attempted /pause, unless dirty: below)
      └─ verify (optional): the worker's digests == the trainer's, bit for bit (verify.py);
                            version matches. /collective_rpc only: never queued behind
                            generation, as a /v1/completions probe would be.

Transactions. A failure after the transfer began leaves the server paused on purpose: its
weights are half-new, and resuming would sample from a model that never existed. The syncer
records the cause in ``dirty``; the next ``sync`` re-sends everything (every sync is a full
send) and resumes on success, or raises again and the run stops with the cause. A failure
before the transfer (``/pause`` timed out, say) resumes as usual. ``SyncResult.phases`` times
each step and ``round_trips`` counts the HTTP calls (gloo: pause, update, version, resume).

Bounds. Every HTTP call, the gloo group and the transfer as a whole end within
``timeout_s`` (the transfer: plus a few seconds' grace, so that an engine's own, more precise
error comes first): a trainer stalled mid-send or a peer that stopped answering fails the sync,
it does not hang it. A stalled transfer is abandoned (its group aborted, the worker's receives
fail at once), and the next sync first closes what the failed one left open on the server
(``grpo_abort_update``: an update vLLM still thinks in progress would refuse every later
``start_weight_update``) and joins a fresh group.

Pause modes. ``keep`` freezes in-flight requests and continues them on the new weights (their
early tokens came from the old policy: staleness *within* a sample, which the importance
ratio against the sampler's logprobs accounts for); vLLM drops their KV cache and recomputes
it under the new weights when they resume. ``wait`` lets them finish first (the sync waits
for the longest request). ``abort`` ends them with ``finish_reason="abort"`` (the generator
must drop or retry them). ``none`` sends no /pause at all: the whole update is one engine
RPC, and vLLM's CPU engine runs RPCs and engine steps in turn (no asynchronous scheduling on
CPU), so no step sees half-new weights; requests in flight go on with the KV the old weights
computed, as in PipelineRL's in-flight updates (the ratio against the sampler's log-probs
accounts for every token); new ones do not reuse it (the ring salts each request with
:func:`policy_salt`; else the syncer drops the prefix cache, which vLLM refuses while busy).
It saves /pause, /resume and the re-prefill of every request in flight. CPU transports only
(``gloo``, ``reload``). A failure mid-transfer pauses the server at once (``abort``), as dirty.
Any failure raises :class:`WeightSyncError`; the caller's version must not advance then.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo_nb.serving.net import free_port
from grpo_nb.weight_sync import verify as check
from grpo_nb.weight_sync.client import VLLMControlClient, WeightSyncError
from grpo_nb.weight_sync.config import EXTENSION, SyncResult, WeightSyncConfig, model_bytes
from grpo_nb.weight_sync.steps import Phases, in_background, within

__all__ = ["EXTENSION", "SyncResult", "WeightSyncConfig", "WeightSyncer", "model_bytes"]
GRACE_S = 5.0  # past timeout_s before a transfer is abandoned (see "Bounds")

class WeightSyncer:
    """Trainer side of weight sync for one model and one server (see module docstring).

    Transactional: once a sync has started changing the served weights, a failure leaves the
    server *paused* (resuming would serve a half-loaded model) and records the cause in
    :attr:`dirty`; the next :meth:`sync` re-sends every tensor and resumes only if that
    succeeds. A failure before that point (e.g. ``/pause`` timed out) still resumes.
    """

    def __init__(self, url: str, model: torch.nn.Module, cfg: WeightSyncConfig | None = None,
                 *, api_key: str | None = None, salted: bool = False) -> None:
        self.cfg = cfg or WeightSyncConfig()
        self.salted = salted  # every sampling request carries policy_salt: no cache to drop
        self.model = model
        self.client = VLLMControlClient(url, timeout=self.cfg.timeout_s, api_key=api_key)
        self.engine: Any = None
        self.version: int | None = None  # last version the server confirmed
        self.dirty: str | None = None  # why the server holds half-loaded weights, if it does
        self._tmp: Path | None = None
        self._model_name: str | None = None
        self._held = False  # the server is paused by a failed "none" sync (see sync)
        self._dtype: torch.dtype | None = None  # the send dtype, once known
        self._armed = False  # the worker records digests and nobody has read them yet

    def send_dtype(self) -> torch.dtype:
        """The dtype tensors travel in: ``cfg.send_dtype``, else the server's (asked once)."""
        if self._dtype is None:
            name = self.cfg.send_dtype
            if name is None:
                answers = self.client.collective_rpc("grpo_model_dtype")
                name = answers[0] if answers else None
            dtype = getattr(torch, str(name), None)
            if not isinstance(dtype, torch.dtype):
                raise WeightSyncError(f"the server did not name its dtype ({name!r}): is "
                                      f"{EXTENSION} loaded (--worker-extension-cls)?")
            self._dtype = dtype
        return self._dtype

    @property
    def send_source(self) -> Any:
        """The trainer's weights as vLLM's engines read them, in :meth:`send_dtype`."""
        from grpo_nb.weight_sync.source import SendSource

        return SendSource(self.model, self.send_dtype)

    # ── setup / teardown ──

    def connect(self) -> None:
        """Join the server's transfer engine (gloo / nccl / ipc); a no-op for ``reload``.

        vLLM's CUDA engines take the calling thread's current device (NCCL builds its
        communicator there, IPC names its GPU) and ``torch.cuda.set_device`` is per thread,
        while the ring syncs from a worker thread: so the engine is built, and every later
        call into it made, under the model's own device, whichever thread calls
        (:mod:`grpo_nb.weight_sync.on_device`).
        """
        if self.engine is not None or self.cfg.transport == "reload":
            return
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from grpo_nb.weight_sync.on_device import OnDevice, device_scope

        device = next(self.model.parameters()).device
        if (device.type == "cuda") != (self.cfg.transport in ("nccl", "ipc")):
            raise WeightSyncError(
                f"WeightSyncConfig.transport={self.cfg.transport!r} cannot send a model on "
                f"{device}: 'nccl' and 'ipc' need it on CUDA, 'gloo' on the CPU "
                "(grpo_nb.llm.placement.sync_of picks the transport for a device)")

        if self.cfg.transport == "gloo":
            from grpo_nb.weight_sync.gloo_engine import GlooTrainerInitInfo, register

            register()
            info: Any = GlooTrainerInitInfo(timeout_s=self.cfg.timeout_s, rank=0)
        elif self.cfg.transport == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0)
        try:
            with device_scope(device):
                engine = WeightTransferTrainerFactory.trainer_init(
                    info, client=self.client, source=self.send_source)
            self.engine = OnDevice(engine, device) if device.type == "cuda" else engine
        except WeightSyncError:
            raise
        except Exception as err:
            raise WeightSyncError(f"could not join the server's {self.cfg.transport} weight "
                                  f"transfer: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Leave the transfer engine. A dirty server stays paused (see :attr:`dirty`)."""
        self._drop_engine()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _drop_engine(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.shutdown()
            self.engine = None

    def __enter__(self) -> WeightSyncer:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ── the sync itself ──

    def sync(self, version: int, *, verify: bool | None = None) -> SyncResult:
        """Send the model's current weights as ``version``; raise :class:`WeightSyncError`.

        ``verify`` overrides ``cfg.verify`` for this call (the ring checks every few syncs
        and always the last one: the worker digests what it receives only then).
        """
        record = self.cfg.verify if verify is None else verify
        phases, trips = Phases(), self.client.round_trips
        start = time.perf_counter()
        touched = False
        paused = self._held  # a dirty server that "none" paused stays so until a full re-send
        failure: BaseException | None = None
        try:
            if self.dirty is not None:
                with phases("reset"):
                    self._reset_server()
            self.connect()
            if self.cfg.pause_mode != "none":
                paused = True  # resume after any attempted /pause
                with phases("pause"):
                    self.client.pause(self.cfg.pause_mode)
            touched = True  # from here on the served weights may be half-new
            self._transfer(str(version), phases, record)
            self.dirty = None
        except BaseException as err:
            failure = err
            if touched:
                self.dirty = f"sync to version {version}: {type(err).__name__}: {err}"
                self._abandon_engine()  # a fresh group next time: this one may be mid-stream
                if not paused:  # "none": stop sampling from half-new weights now
                    with contextlib.suppress(Exception):
                        self.client.pause("abort")
                        paused = True
        finally:
            resume_error = self._resume(phases) if paused and not self.dirty else None
            self._held = paused and self.dirty is not None
        if failure is not None:
            raise self._failure(version, failure, touched, resume_error) from failure
        if resume_error is not None:
            raise WeightSyncError(f"weights for version {version} loaded, but /resume "
                                  f"failed: {resume_error}") from resume_error
        phases["total"] = (time.perf_counter() - start) * 1e3
        result = SyncResult(version, phases["total"], model_bytes(self.model, self._dtype),
                            None, dict(phases), self.client.round_trips - trips)
        if record:
            result.verified = self.verify(version)
        self.version = version
        return result

    def _resume(self, phases: Phases) -> BaseException | None:
        try:
            with phases("resume"):
                self.client.resume()
        except Exception as err:  # reported by sync(), after any earlier failure
            return err
        return None

    def _failure(self, version: int, err: BaseException, touched: bool,
                 resume_error: BaseException | None) -> BaseException:
        if not isinstance(err, Exception):
            return err  # KeyboardInterrupt & co. propagate as they are
        cause = err if isinstance(err, WeightSyncError) else f"{type(err).__name__}: {err}"
        if self.dirty is not None:
            where = "mid-transfer" if touched else "before its transfer"
            if not self._held:  # "none" and its /pause?mode=abort failed too (server gone?)
                return WeightSyncError(
                    f"weight sync to version {version} failed {where} ({cause}), and the "
                    f"server could not be paused: it may serve half-loaded weights "
                    f"({self.dirty}) until the next sync re-sends every tensor")
            return WeightSyncError(
                f"weight sync to version {version} failed {where} ({cause}); the server stays "
                f"PAUSED because its weights are half-loaded ({self.dirty}): the next sync "
                "re-sends every tensor and resumes it only if that succeeds")
        if resume_error is not None:
            return WeightSyncError(f"weight sync to version {version} failed ({cause}), and "
                                   f"/resume failed too: {resume_error}")
        return err if isinstance(err, WeightSyncError) else WeightSyncError(
            f"weight sync to version {version} failed: {cause}")

    def _transfer(self, version: str, phases: Phases, record: bool) -> None:
        """Send every tensor (as the transport does it), then name the version now served."""
        if self.cfg.transport != "gloo" and (record or self._armed):
            # gloo says it in its update RPC; an armed record nobody read is restarted too
            self.client.collective_rpc("grpo_begin_update", {"record": record},
                                       timeout=self.cfg.timeout_s)
        self._armed = record
        if self.cfg.transport == "reload":
            self._reload(phases)
        elif self.cfg.transport == "gloo":
            self._bounded(lambda: self.engine.send_weights(record=record))
            report = self.engine.last
            server = report.server
            phases.update(transfer=report.send_ms, rpc=report.rpc_ms,
                          start=server.get("start_ms", 0.0), wait=server.get("wait_ms", 0.0),
                          load=server.get("load_ms", 0.0), finish=server.get("finish_ms", 0.0))
        else:
            with phases("transfer"):
                self._bounded(self.engine.send_weights)
        self._forget_old_prompts(phases)
        with phases("version"):
            self.client.set_weight_version(version)

    def _bounded(self, send: Callable[[], None]) -> None:
        """One transfer, given up after ``timeout_s`` + grace: a trainer stalled mid-send (a
        slow gather, a hung device call) or a blocked broadcast fails the sync instead of
        hanging it; the failure path then abandons the engine (see "Bounds")."""
        limit = self.cfg.timeout_s + GRACE_S
        try:
            within(limit, send, f"{self.cfg.transport} transfer")
        except TimeoutError as err:
            raise WeightSyncError(f"{err} (WeightSyncConfig.timeout_s={self.cfg.timeout_s} + "
                                  f"{GRACE_S:.0f} s): abandoned, its group closed") from None

    def _abandon_engine(self) -> None:
        """Drop the engine after a failure; shut it down on a daemon thread (a gloo group
        aborts at once, a CUDA communicator with a send in flight may never return)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            in_background(engine.shutdown, "grpo-engine-shutdown")

    def _reset_server(self) -> None:
        """After a failed sync: close the update it left open on the server (see "Bounds")."""
        try:
            self.client.collective_rpc("grpo_abort_update", timeout=self.cfg.timeout_s)
        except WeightSyncError as err:
            raise WeightSyncError(f"could not close the failed weight update on the server "
                                  f"(grpo_abort_update): {err}") from err

    def _forget_old_prompts(self, phases: Phases) -> None:
        """``none``: drop the old weights' prompt KV (vLLM refuses while requests hold it)."""
        if self.cfg.pause_mode == "none" and not self.salted:
            with phases("cache"):
                self.client.reset_prefix_cache()

    def _reload(self, phases: Phases) -> None:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="grpo_nb_weights_"))
        # safetensors of what every transport sends: what vLLM's loader reads, no config files.
        from safetensors.torch import save_file

        with phases("transfer"):
            state = {name: t.to("cpu").contiguous()
                     for name, t in check.sent_tensors(self.model, self.send_dtype())}
            save_file(state, str(self._tmp / "model.safetensors"))
        with phases("load"):
            self.client.collective_rpc("grpo_reload_weights",
                                       {"weights_path": str(self._tmp)},
                                       timeout=self.cfg.timeout_s)

    # ── verification ──

    def verify(self, version: int | None = None) -> bool:
        """Raise unless the server received exactly the trainer's weights (and serves weight
        ``version``): every parameter, cast to the send dtype, reached the server model's
        ``load_weights`` once, bit for bit, in the last sync made with ``verify=True``
        (:mod:`grpo_nb.weight_sync.verify`). Exact in every dtype and transport.
        """
        records = self.client.collective_rpc("grpo_update_record", timeout=self.cfg.timeout_s)
        self._armed = False
        expected = check.expected_digests(self.model, self.send_dtype())
        for rank, received in enumerate(records or [None]):
            problem = check.compare(expected, received)
            if problem is not None:
                where = f" (worker {rank})" if len(records) > 1 else ""
                raise WeightSyncError(f"served weights differ from the trainer's{where}: "
                                      f"{problem}")
        if version is not None:
            served_version = self.client.weight_version()
            if served_version != str(version):
                raise WeightSyncError(f"server reports weight version {served_version!r}, "
                                      f"expected {str(version)!r}")
        return True

    def probe(self) -> list[list[int]]:
        """Fixed token sequences for :meth:`weight_gap` (seeded, the model's vocabulary)."""
        return check.probe_ids(int(self.model.config.vocab_size), self.cfg.probe_batch,
                               self.cfg.probe_len)

    def weight_gap(self) -> float:
        """Largest |log-prob difference| between server and trainer on the probe: the
        behavioural view of a sync (teaching; read against ``cfg.atol``). Float32 sides agree
        to ~1e-5; bf16 kernels round differently, which is why :meth:`verify` is exact."""
        if self._model_name is None:
            self._model_name = self.client.model_name()
        ids = self.probe()
        served = check.server_logprobs(self.client, self._model_name, ids)
        return float((served - check.trainer_logprobs(self.model, ids, self.send_dtype()))
                     .abs().max())
