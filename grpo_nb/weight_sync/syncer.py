"""Push the trainer's weights into a running vLLM server (``/pause``, every tensor, the version,
``/resume``, each step bounded) and prove they arrived and were applied. A sync moves through
:class:`State`: a half-sent server stays paused (``DIRTY``) until a full re-send succeeds; after
an NCCL update the server never answered (``WEDGED``) every later sync is refused (the server
must be restarted)."""

from __future__ import annotations

import contextlib
import enum
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from grpo_nb import grpo
from grpo_nb.serving.control import VLLMControlClient, WeightSyncError
from grpo_nb.weight_sync import verify as check
from grpo_nb.weight_sync.config import EXTENSION, Phases, SyncResult, WeightSyncConfig, model_bytes

GRACE_S = 5.0  # past the transfer's limit (transfer_limit) before it is abandoned


class State(enum.Enum):
    """Where the served weights stand. A sync goes ``CLEAN`` → ``PAUSED`` (its ``/pause``; not
    with ``pause_mode="none"``) → ``SENDING`` (from its first tensor the served weights may be
    half-new) → ``CLEAN``; a failure while ``SENDING`` leaves ``DIRTY`` (paused until a sync
    re-sends every tensor), ``EXPOSED`` (the same, but the server could not be paused: it may
    serve half-new weights) or ``WEDGED`` (final)."""

    CLEAN = "clean"
    PAUSED = "paused"
    SENDING = "sending"
    DIRTY = "dirty"
    EXPOSED = "exposed"
    WEDGED = "wedged"


class _Fence:
    """The control client as one transfer engine holds it: once the syncer abandons the engine
    (:meth:`close`) every call is refused, so its thread, still running, cannot act on the next
    sync's update. :attr:`receiving`: an ``update_weights`` was sent that the server has not
    answered (its worker may still be inside that receive)."""

    CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
             "finish_weight_update", "collective_rpc")  # vLLM's VLLMWeightSyncClient and RPCs

    def __init__(self, client: VLLMControlClient) -> None:
        self.client, self.open, self.receiving = client, True, False
        self.lock = threading.Lock()

    def close(self) -> bool:
        """Refuse every later call; returns :attr:`receiving` as it was then."""
        with self.lock:
            self.open = False
            return self.receiving

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.client, name)
        if name not in self.CALLS:
            return call
        update = name == "update_weights"

        def fenced(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                if not self.open:
                    raise WeightSyncError(f"{name} refused: the sync that started this transfer "
                                          "abandoned it")
                self.receiving = self.receiving or update
            try:
                answer = call(*args, **kwargs)
            except WeightSyncError as err:
                if update and err.status is not None:  # answered: its worker left the receive
                    self.receiving = False
                raise
            if update:
                self.receiving = False
            return answer

        return fenced


class WeightSyncer:
    """Weight sync for one trainer model and one server. :attr:`version`: the last version the
    server confirmed (the one owner of it: the trainer reads :class:`SyncResult`); :attr:`state`
    (:class:`State`) and :attr:`why`: what a failed sync left; :meth:`send_dtype`: the dtype the
    weights travel in."""

    def __init__(self, url: str, model: torch.nn.Module, cfg: WeightSyncConfig | None = None,
                 *, api_key: str | None = None, salted: bool = False) -> None:
        self.cfg = cfg or WeightSyncConfig()
        self.salted = salted  # every sampling request carries policy_salt: no cache to drop
        self.model = model
        self.client = VLLMControlClient(url, timeout=self.cfg.timeout_s, api_key=api_key)
        self.engine: Any = None
        self.version: int | None = None
        self.state = State.CLEAN
        self.why: str | None = None  # the failed sync (DIRTY, EXPOSED) or the fix (WEDGED)
        self._fence: _Fence | None = None  # the engine's client, closed once abandoned
        self._tmp: Path | None = None
        self._dtype: torch.dtype | None = None
        self._armed = False  # the worker records digests and nobody has read them yet
        self.proof = check.Proof(self.cfg.send_dtype, self.cfg.timeout_s)

    @property
    def dirty(self) -> str | None:
        """Why the server holds half-loaded weights, if it does."""
        return None if self.state is State.CLEAN else self.why

    @property
    def wedged(self) -> str | None:
        """Why no sync can reach the server any more (it must be restarted), if so."""
        return self.why if self.state is State.WEDGED else None

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

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

    def transfer_limit(self) -> float:
        """Seconds one transfer may take: ``cfg.transfer_timeout`` of the bytes a sync sends."""
        return self.cfg.transfer_timeout(model_bytes(self.model, self.send_dtype()))

    def connect(self) -> None:
        """Join the server's transfer engine (not for ``reload``), under the model's device:
        vLLM's CUDA engines use the calling thread's current device."""
        if self.engine is not None or self.cfg.transport == "reload":
            return
        from grpo_nb.weight_sync.gloo_engine import SendSource, trainer_engine  # vLLM's gate

        device = self._device()
        if (device.type == "cuda") != (self.cfg.transport in ("nccl", "ipc")):
            raise WeightSyncError(
                f"WeightSyncConfig.transport={self.cfg.transport!r} cannot send a model on "
                f"{device}: 'nccl' and 'ipc' need it on CUDA, 'gloo' on the CPU "
                "(grpo_nb.llm.placement.sync_of picks the transport for a device)")
        source = SendSource(self.model, self.send_dtype())  # asks the server: its own error
        limit = self.transfer_limit()
        self.client.update_timeout = limit
        self._fence = _Fence(self.client)
        try:
            with device_scope(device):
                self.engine = trainer_engine(self.cfg.transport, self._fence, source, limit)
        except Exception as err:
            raise WeightSyncError(f"could not join the server's {self.cfg.transport} weight "
                                  f"transfer: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Leave the transfer engine. A dirty server stays paused (see :attr:`state`)."""
        engine, self.engine = self.engine, None
        _shutdown(engine, self._device())
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> WeightSyncer:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync(self, version: int, *, verify: bool | None = None) -> SyncResult:
        """Send the model's weights as ``version``; ``verify`` overrides ``cfg.verify``."""
        if self.state is State.WEDGED:  # any request would queue behind the stuck receive
            raise WeightSyncError(f"weight sync to version {version} refused: {self.why}")
        record = self.cfg.verify if verify is None else verify
        phases, trips, start = Phases(), self.client.round_trips, time.perf_counter()
        before = self.state  # CLEAN, DIRTY or EXPOSED
        paused = before is State.DIRTY  # resumed only once a full re-send succeeds
        try:
            if before is not State.CLEAN:  # close the update the failed sync left open
                with phases("reset"):
                    self.client.collective_rpc("grpo_abort_update", timeout=self.transfer_limit())
            self.connect()
            # kv="recompute": the running requests end here, their tokens returned for the
            # sampler to resubmit, and vLLM queues what arrives until /resume (new weights)
            pause = "abort" if self.cfg.kv == "recompute" else self.cfg.pause_mode
            if pause != "none":
                paused, self.state = True, State.PAUSED  # resume after any attempted /pause
                with phases("pause"):
                    self.client.pause(pause)
            self.state = State.SENDING
            self._transfer(str(version), phases, record)
        except BaseException as err:
            sent = self.state is State.SENDING
            if sent:
                paused = self._abandon(f"sync to version {version}: {type(err).__name__}: {err}",
                                       paused)
            elif before is not State.CLEAN:
                self.state = State.DIRTY if paused else State.EXPOSED
            else:
                self.state = State.CLEAN
            resume_error = self._resume(phases) if self.state is State.CLEAN and paused else None
            raise self._failure(version, err, sent, resume_error) from err
        self.state = State.CLEAN
        if paused and (resume_error := self._resume(phases)) is not None:
            raise WeightSyncError(f"weights for version {version} loaded, but /resume "
                                  f"failed: {resume_error}") from resume_error
        phases["total"] = (time.perf_counter() - start) * 1e3
        result = SyncResult(version, phases["total"], model_bytes(self.model, self._dtype),
                            None, dict(phases), self.client.round_trips - trips)
        if record:
            result.verified = self.verify(version)
            result.applied = self.proof.applied
        self.version = version
        return result

    def _abandon(self, why: str, paused: bool) -> bool:
        """A sync failed while ``SENDING``: close its engine's client and leave its engine (a
        fresh one next time), then pause a server that "none" left running; whether paused."""
        self.state, self.why = State.DIRTY, why
        fence, self._fence = self._fence, None
        if fence is not None and fence.close() and self.cfg.transport == "nccl":
            self.state, self.why = State.WEDGED, self._wedged_reason()
        engine, self.engine = self.engine, None
        if engine is not None:  # a gloo group aborts at once; a CUDA one mid-send may never
            from grpo_nb.weight_sync.gloo_engine import beside

            beside(lambda: _shutdown(engine, self._device()), "grpo-shutdown")
        if not paused:  # "none": stop sampling from half-new weights now
            with contextlib.suppress(Exception):
                self.client.pause("abort")
                paused = True
        if self.state is State.DIRTY and not paused:
            self.state = State.EXPOSED
        return paused

    def _resume(self, phases: Phases) -> Exception | None:
        try:
            with phases("resume"):
                self.client.resume()
        except Exception as err:
            return err
        return None

    def _failure(self, version: int, err: BaseException, sent: bool,
                 resume_error: BaseException | None) -> BaseException:
        if not isinstance(err, Exception):
            return err  # KeyboardInterrupt & co. propagate as they are
        failed = f"weight sync to version {version} failed"
        cause = err if isinstance(err, WeightSyncError) else f"{type(err).__name__}: {err}"
        if self.state is State.CLEAN:
            also = f", and /resume failed too: {resume_error}" if resume_error else ""
            return WeightSyncError(f"{failed}: {cause}{also}")
        where = "mid-transfer" if sent else "before its transfer"
        if self.state is State.WEDGED:
            return WeightSyncError(f"{failed} {where} ({cause}); {self.why}")
        state = ("stays PAUSED with half-loaded weights" if self.state is State.DIRTY
                 else "could not be paused: it may serve half-loaded weights")
        return WeightSyncError(f"{failed} {where} ({cause}); the server {state} ({self.why}) "
                               "until the next sync re-sends every tensor and succeeds")

    def _wedged_reason(self) -> str:
        """An NCCL update the server never answered: vLLM's worker receives in
        ``packed_nccl_broadcast_consumer`` with no timeout, waiting for tensors this trainer,
        its communicator aborted, will not send; RPCs run on that worker's thread."""
        gb = model_bytes(self.model, self._dtype) / 1e9
        return ("the server cannot be recovered: its worker may still wait inside vLLM's NCCL "
                "receive for tensors this trainer no longer sends, and every request to it, an "
                "abort included, queues behind that receive. Restart the vLLM server, then sync "
                "through a new WeightSyncer (if the transfer was only slow, raise "
                f"WeightSyncConfig.timeout_s: this one had {self.transfer_limit():.0f} s for "
                f"{gb:.2f} GB)")

    def _transfer(self, version: str, phases: Phases, record: bool) -> None:
        """Send every tensor (as the transport does it), then name the version now served."""
        if self.cfg.transport != "gloo" and (record or self._armed):
            # gloo says it in its update RPC; an armed record nobody read is restarted too
            self.client.collective_rpc("grpo_begin_update", {"record": record},
                                       timeout=self.cfg.timeout_s)
        self._armed = record
        if self.cfg.transport == "reload":
            self._reload(phases)
        else:
            with phases("transfer"):
                self._bounded(lambda: self.engine.send_weights(record=record)
                              if self.cfg.transport == "gloo" else self.engine.send_weights())
            phases.update(getattr(self.engine, "last", {}))  # gloo: the server's own phases
        if self.cfg.pause_mode == "none" and not self.salted:
            with phases("cache"):  # the old weights' prompt KV (vLLM refuses while it is used)
                self.client.reset_prefix_cache()
        # The label vLLM stamps on every token it samples from now on (/inference/v1/generate's
        # weight_versions). Paused ("keep", "abort"): exact. "none": the engine steps once or
        # more between the load and this call, so the first tokens of the new weights keep the
        # old label (a lag overstated by 1, never understated)
        with phases("version"):
            self.client.set_weight_version(version)

    def _bounded(self, send: Callable[[], None]) -> None:
        """One transfer on the sync's one thread (``gloo_engine.beside``), under the model's
        device, abandoned after its limit + ``GRACE_S``: its caller never hangs."""
        from grpo_nb.weight_sync.gloo_engine import beside

        allowed, device = self.transfer_limit(), self._device()
        limit = allowed + GRACE_S

        def run() -> None:
            with device_scope(device):
                send()

        transfer = beside(run, "grpo-transfer")
        if not wait([transfer], limit).done:
            raise WeightSyncError(
                f"{self.cfg.transport} transfer did not finish within {limit:.0f} s "
                f"({allowed:.0f} s for the model's bytes, WeightSyncConfig.transfer_timeout at "
                f"timeout_s={self.cfg.timeout_s}, + {GRACE_S:.0f} s): abandoned, its group closed")
        transfer.result()

    def _reload(self, phases: Phases) -> None:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="grpo_nb_weights_"))
        with phases("transfer"):  # what every transport sends, as the safetensors vLLM reads
            state = {name: t.to("cpu").contiguous()
                     for name, t in check.sent_tensors(self.model, self.send_dtype())}
            save_file(state, str(self._tmp / "model.safetensors"))
        with phases("load"):
            self.client.collective_rpc("grpo_reload_weights", {"weights_path": str(self._tmp)},
                                       timeout=self.transfer_limit())

    def verify(self, version: int | None = None) -> bool:
        """Raise unless the last ``verify=True`` sync delivered every parameter once, bit for
        bit, the served parameters changed wherever the trainer's did since the previous
        verification, and the server serves weight ``version`` (:class:`verify.Proof`)."""
        if self.wedged is not None:
            raise WeightSyncError(f"verification refused: {self.wedged}")
        records = self.client.collective_rpc("grpo_update_record", timeout=self.cfg.timeout_s)
        self._armed = False
        self.proof.check(records, self.client, self.model, self.send_dtype(),
                         self.transfer_limit())
        if version is not None:
            served_version = self.client.weight_version()
            if served_version != str(version):
                raise WeightSyncError(f"server reports weight version {served_version!r}, "
                                      f"expected {str(version)!r}")
        return True

    def weight_gap(self) -> float:
        """Largest |log-prob difference| between server and trainer on fixed random tokens,
        read against ``cfg.atol`` (never exactly 0 in bf16: :meth:`verify` is the proof)."""
        if self.wedged is not None:
            raise WeightSyncError(f"probe refused: {self.wedged}")
        gen = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, int(self.model.config.vocab_size),
                            (self.cfg.probe_batch, self.cfg.probe_len), generator=gen)
        served = torch.tensor(self.client.prompt_logprobs(ids.tolist()), dtype=torch.float64)
        param = next(self.model.parameters())
        dtype = self.send_dtype()
        x = ids.to(param.device)
        cast = dtype != torch.float32 and param.dtype == torch.float32  # fp32 masters, bf16 server
        with torch.no_grad(), torch.autocast(param.device.type, dtype=dtype, enabled=cast):
            mine = grpo.sequence_logprobs(self.model, x, torch.ones_like(x), 1.0)
        return float((served - mine.double().cpu()).abs().max())


def _shutdown(engine: Any, device: torch.device) -> None:
    if engine is not None:
        with contextlib.suppress(Exception), device_scope(device):
            engine.shutdown()


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(device)`` for a CUDA device; nothing otherwise."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
