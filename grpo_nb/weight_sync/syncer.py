"""Push the trainer's weights into a running vLLM server (``/pause``, every tensor, the version,
``/resume``, each step bounded) and prove they arrived and were applied; a half-sent server
stays paused; after an NCCL update the server never answered, every later sync is refused
(the server must be restarted)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from grpo_nb import grpo
from grpo_nb.weight_sync import verify as check
from grpo_nb.weight_sync.client import EngineClient, VLLMControlClient, WeightSyncError
from grpo_nb.weight_sync.config import EXTENSION, Phases, SyncResult, WeightSyncConfig, model_bytes

GRACE_S = 5.0  # past the transfer's limit (transfer_limit) before it is abandoned


class WeightSyncer:
    """Weight sync for one trainer model and one server. :attr:`version`: the last version
    the server confirmed; :attr:`dirty`: why the server holds half-loaded weights, if it does;
    :attr:`wedged`: why no sync can reach the server any more (it must be restarted)."""

    def __init__(self, url: str, model: torch.nn.Module, cfg: WeightSyncConfig | None = None,
                 *, api_key: str | None = None, salted: bool = False) -> None:
        self.cfg = cfg or WeightSyncConfig()
        self.salted = salted  # every sampling request carries policy_salt: no cache to drop
        self.model = model
        self.client = VLLMControlClient(url, timeout=self.cfg.timeout_s, api_key=api_key)
        self.engine: Any = None
        self.version: int | None = None
        self.dirty: str | None = None
        self.wedged: str | None = None
        self._fence: EngineClient | None = None  # the engine's client, refused once abandoned
        self._tmp: Path | None = None
        self._held = False  # the server is paused by a failed "none" sync
        self._dtype: torch.dtype | None = None
        self._armed = False  # the worker records digests and nobody has read them yet
        # after the last verified sync: the trainer's digests and the served checksums
        self._served: tuple[dict[str, str], dict[str, str]] | None = None
        self._packed: dict[str, list[str]] | None = None  # the served model's fused modules
        self._casts: bool | None = None  # the server casts what it loads (send_dtype differs)
        self.applied: int | None = None  # what the last verify() saw applied (SyncResult)

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
        self._fence = EngineClient(self.client)
        try:
            with device_scope(device):
                self.engine = trainer_engine(self.cfg.transport, self._fence, source, limit)
        except Exception as err:
            raise WeightSyncError(f"could not join the server's {self.cfg.transport} weight "
                                  f"transfer: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Leave the transfer engine. A dirty server stays paused (see :attr:`dirty`)."""
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
        if self.wedged is not None:  # any request would queue behind the stuck receive
            raise WeightSyncError(f"weight sync to version {version} refused: {self.wedged}")
        record = self.cfg.verify if verify is None else verify
        phases, trips = Phases(), self.client.round_trips
        start = time.perf_counter()
        touched = False
        paused = self._held  # a dirty server that "none" paused stays so until a full re-send
        failure: BaseException | None = None
        try:
            if self.dirty is not None:  # close the update the failed sync left open
                with phases("reset"):
                    self.client.collective_rpc("grpo_abort_update",
                                               timeout=self.transfer_limit())
            self.connect()
            # kv="recompute": the running requests end here, their tokens returned for the
            # sampler to resubmit, and vLLM queues what arrives until /resume (new weights)
            pause = "abort" if self.cfg.kv == "recompute" else self.cfg.pause_mode
            if pause != "none":
                paused = True  # resume after any attempted /pause
                with phases("pause"):
                    self.client.pause(pause)
            touched = True  # from here on the served weights may be half-new
            self._transfer(str(version), phases, record)
            self.dirty = None
        except BaseException as err:
            failure = err
            if touched:
                self.dirty = f"sync to version {version}: {type(err).__name__}: {err}"
                fence, self._fence = self._fence, None
                if fence is not None and fence.revoke() and self.cfg.transport == "nccl":
                    self.wedged = self._wedged_reason()
                engine, self.engine = self.engine, None  # a fresh group next time
                # A gloo group aborts at once; a CUDA communicator mid-send may never return.
                threading.Thread(target=_shutdown, args=(engine, self._device()),
                                 daemon=True).start()
                if not paused:  # "none": stop sampling from half-new weights now
                    with contextlib.suppress(Exception):
                        self.client.pause("abort")
                        paused = True
        resume_error = None  # reported after any earlier failure
        if paused and not self.dirty:
            try:
                with phases("resume"):
                    self.client.resume()
            except Exception as err:
                resume_error = err
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
            result.applied = self.applied
        self.version = version
        return result

    def _failure(self, version: int, err: BaseException, touched: bool,
                 resume_error: BaseException | None) -> BaseException:
        if not isinstance(err, Exception):
            return err  # KeyboardInterrupt & co. propagate as they are
        failed = f"weight sync to version {version} failed"
        cause = err if isinstance(err, WeightSyncError) else f"{type(err).__name__}: {err}"
        if self.dirty is None:
            also = f", and /resume failed too: {resume_error}" if resume_error else ""
            return WeightSyncError(f"{failed}: {cause}{also}")
        where = "mid-transfer" if touched else "before its transfer"
        if self.wedged is not None:
            return WeightSyncError(f"{failed} {where} ({cause}); {self.wedged}")
        # not held: "none", and its /pause?mode=abort failed too (server gone?)
        state = ("stays PAUSED with half-loaded weights" if self._held
                 else "could not be paused: it may serve half-loaded weights")
        return WeightSyncError(f"{failed} {where} ({cause}); the server {state} ({self.dirty}) "
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
        elif self.cfg.transport == "gloo":
            self._bounded(lambda: self.engine.send_weights(record=record))
            phases.update(self.engine.last)
        else:
            with phases("transfer"):
                self._bounded(self.engine.send_weights)
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
        """One transfer on a daemon thread, abandoned after its limit + ``GRACE_S``."""
        allowed = self.transfer_limit()
        limit = allowed + GRACE_S
        device, failed = self._device(), []

        def run() -> None:
            try:
                with device_scope(device):
                    send()
            except BaseException as err:  # handed to the waiting thread
                failed.append(err)

        thread = threading.Thread(target=run, daemon=True, name="grpo-transfer")
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            raise WeightSyncError(
                f"{self.cfg.transport} transfer did not finish within {limit:.0f} s "
                f"({allowed:.0f} s for the model's bytes, WeightSyncConfig.transfer_timeout at "
                f"timeout_s={self.cfg.timeout_s}, + {GRACE_S:.0f} s): abandoned, its group closed")
        if failed:
            raise failed[0]

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
        verification (:meth:`_check_applied`), and the server serves weight ``version``."""
        if self.wedged is not None:
            raise WeightSyncError(f"verification refused: {self.wedged}")
        records = self.client.collective_rpc("grpo_update_record", timeout=self.cfg.timeout_s)
        self._armed = False
        expected = check.expected_digests(self.model, self.send_dtype())
        for rank, received in enumerate(records or [None]):
            problem = check.compare(expected, received)
            if problem is not None:
                where = f" (worker {rank})" if len(records) > 1 else ""
                raise WeightSyncError(f"served weights differ from the trainer's{where}: "
                                      f"{problem}")
        self._check_applied(expected)
        if version is not None:
            served_version = self.client.weight_version()
            if served_version != str(version):
                raise WeightSyncError(f"server reports weight version {served_version!r}, "
                                      f"expected {str(version)!r}")
        return True

    def _check_applied(self, sent: dict[str, str]) -> None:
        """The received digests prove what ``load_weights`` was handed; this, that it landed:
        vLLM's ``/weight_checker`` checksums of the served parameters, against those after the
        previous verification, must differ wherever the sent digests do (the first verification
        only records them). :attr:`applied`: how many changed tensors that checked. Not
        checked when ``cfg.send_dtype`` is not the server's: its cast may round a change away."""
        self.applied = None
        if self._casts is None:
            self._casts = self.cfg.send_dtype is not None and self.cfg.send_dtype not in (
                self.client.collective_rpc("grpo_model_dtype", timeout=self.cfg.timeout_s))
        if self._casts:
            return
        live = self.client.weight_checksums(timeout=self.transfer_limit())
        if self._packed is None:
            answers = self.client.collective_rpc("grpo_packed_modules", timeout=self.cfg.timeout_s)
            self._packed = answers[0] if answers else {}
        if self._served is not None:
            then_sent, then_live = self._served
            targets = check.served_targets(sent, live, self._packed)
            problem, self.applied = check.unapplied(then_sent, sent, then_live, live, targets)
            if problem is not None:  # the baseline stays: a re-sync is compared with it again
                raise WeightSyncError(f"served parameters did not change where the trainer's "
                                      f"did since the last verified sync: {problem}")
        self._served = (sent, live)

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
