"""Push the trainer's weights into a running vLLM server, and prove they arrived.

One :class:`WeightSyncer` per (trainer model, server). Each :meth:`WeightSyncer.sync` runs
vLLM's own weight-update flow and sets a new weight version on the server::

    sync(version)
      ├─ /pause?mode=keep|wait|abort   (no token from half-new weights; "none": see below)
      ├─ transport
      │    gloo   : vLLM WeightTransferTrainerFactory → our gloo engine (start + update +
      │             finish in one /collective_rpc, overlapped with our broadcasts)
      │    nccl   : the same factory → vLLM's NCCL engine (trainer and server on 2 GPUs)
      │    ipc    : the same factory → vLLM's CUDA-IPC engine (trainer and server share a GPU)
      │    reload : save safetensors → /collective_rpc reload_weights(weights_path=DIR)
      ├─ weight version := str(version)
      ├─ /resume                          (after any attempted /pause, unless dirty: below)
      └─ verify (optional): server's probe log-probs == trainer's, version matches

Transactions. A failure after the transfer began leaves the server paused on purpose: its
weights are half-new, and resuming would sample from a model that never existed. The syncer
records the cause in ``dirty``; the next ``sync`` re-sends everything (every sync is a full
send) and resumes on success, or raises again and the run stops with the cause. A failure
before the transfer (``/pause`` timed out, say) resumes as usual. ``SyncResult.phases`` times
each step and ``round_trips`` counts the HTTP calls (gloo: pause, update, version, resume).

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from grpo_nb.serving.net import free_port
from grpo_nb.weight_sync.client import VLLMControlClient, WeightSyncError

Transport = Literal["gloo", "reload", "nccl", "ipc"]
PauseMode = Literal["keep", "wait", "abort", "none"]
EXTENSION = "grpo_nb.weight_sync.worker.GrpoWorkerExtension"


@dataclass
class WeightSyncConfig:
    """How weights travel to the server.

    Args:
        transport: ``gloo`` (CPU, our engine), ``reload`` (CPU, from disk), ``nccl`` (GPU,
            one per side) or ``ipc`` (GPU shared by trainer and server).
        pause_mode: what happens to in-flight requests during a sync (see module docstring).
        verify: after each sync, check that the served weights equal the trainer's.
        chunk_mb: unused (the gloo engine sends each tensor as it is; old configs load).
        timeout_s: HTTP and process-group timeout; bounds how long a dead peer can block.
        atol: largest probe log-prob difference that still counts as "same weights".
        probe_batch / probe_len: size of the probe used by :meth:`WeightSyncer.verify`.
    """

    transport: Transport = "gloo"
    pause_mode: PauseMode = "keep"
    verify: bool = True
    chunk_mb: int = 64
    timeout_s: float = 20.0
    atol: float = 1e-3
    probe_batch: int = 4
    probe_len: int = 32

    def __post_init__(self) -> None:
        if self.transport not in ("gloo", "reload", "nccl", "ipc"):
            raise ValueError(f"WeightSyncConfig.transport={self.transport!r}: "
                             "use 'gloo', 'reload', 'nccl' or 'ipc'")
        if self.pause_mode not in ("keep", "wait", "abort", "none"):
            raise ValueError(f"WeightSyncConfig.pause_mode={self.pause_mode!r}: "
                             "use 'keep', 'wait', 'abort' or 'none'")
        if self.pause_mode == "none" and self.transport not in ("gloo", "reload"):
            raise ValueError(f"WeightSyncConfig.pause_mode='none' needs a CPU transport "
                             f"('gloo' or 'reload'), not {self.transport!r}: only vLLM's CPU "
                             "engine surely runs the update between two steps (use 'keep')")
        if self.chunk_mb < 1:
            raise ValueError(f"WeightSyncConfig.chunk_mb={self.chunk_mb}: must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError(f"WeightSyncConfig.timeout_s={self.timeout_s}: must be > 0")

    @classmethod
    def smoke(cls) -> WeightSyncConfig:
        return cls()

    def server_settings(self) -> dict[str, Any]:
        """The ``serving.ServerConfig`` fields the server needs for this transport."""
        backend = None if self.transport == "reload" else {"backend": self.transport}
        settings: dict[str, Any] = {"worker_extension_cls": EXTENSION,
                                    "weight_transfer_config": backend, "dev_mode": True}
        if self.transport == "ipc":  # CUDA-IPC handles travel pickled over HTTP
            settings["env"] = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
        return settings


@dataclass
class SyncResult:
    """What one sync did: the version now served, its duration and size, and the check.

    ``phases`` holds milliseconds per phase: ``pause``, ``transfer`` (trainer side: gloo sends
    / safetensors write), ``load`` (server side: ``load_weights`` / the reload RPC),
    ``finish`` (server side: layer processing after the last tensor; gloo), ``cache`` (``none``,
    unsalted: the prefix-cache reset), ``version``, ``resume`` and ``total``; gloo adds the server's
    ``start``, ``wait`` (blocked on the wire) and ``rpc`` (the update call seen by the trainer).
    ``round_trips`` counts the HTTP calls the sync made (verification not included).
    """

    version: int
    ms: float
    bytes: int
    verified: bool | None  # None: not checked
    phases: dict[str, float] = field(default_factory=dict)
    round_trips: int = 0


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _Phases(dict):
    """``with phases("pause"): …`` records the block's milliseconds under that name."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + (time.perf_counter() - t) * 1e3


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
        self.last_gap: float | None = None
        self._held = False  # the server is paused by a failed "none" sync (see sync)

    # ── setup / teardown ──

    def connect(self) -> None:
        """Join the server's transfer engine (gloo / nccl); a no-op for ``reload``."""
        if self.engine is not None or self.cfg.transport == "reload":
            return
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

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
            self.engine = WeightTransferTrainerFactory.trainer_init(
                info, client=self.client, source=ModuleSource(self.model))
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
        and always the last one: each check costs a few probe requests).
        """
        phases, trips = _Phases(), self.client.round_trips
        start = time.perf_counter()
        touched = False
        paused = self._held  # a dirty server that "none" paused stays so until a full re-send
        failure: BaseException | None = None
        try:
            self.connect()
            if self.cfg.pause_mode != "none":
                paused = True  # resume after any attempted /pause
                with phases("pause"):
                    self.client.pause(self.cfg.pause_mode)
            touched = True  # from here on the served weights may be half-new
            self._transfer(str(version), phases)
            self.dirty = None
        except BaseException as err:
            failure = err
            if touched:
                self.dirty = f"sync to version {version}: {type(err).__name__}: {err}"
                self._drop_engine()  # a fresh group next time: this one may be mid-stream
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
        result = SyncResult(version, phases["total"], model_bytes(self.model), None,
                            dict(phases), self.client.round_trips - trips)
        if self.cfg.verify if verify is None else verify:
            result.verified = self.verify(version)
        self.version = version
        return result

    def _resume(self, phases: _Phases) -> BaseException | None:
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

    def _transfer(self, version: str, phases: _Phases) -> None:
        """Send every tensor (as the transport does it), then name the version now served."""
        if self.cfg.transport == "reload":
            self._reload(phases)
        elif self.cfg.transport == "gloo":
            self.engine.send_weights()
            report = self.engine.last
            server = report.server
            phases.update(transfer=report.send_ms, rpc=report.rpc_ms,
                          start=server.get("start_ms", 0.0), wait=server.get("wait_ms", 0.0),
                          load=server.get("load_ms", 0.0), finish=server.get("finish_ms", 0.0))
        else:
            with phases("transfer"):
                self.engine.send_weights()
        self._forget_old_prompts(phases)
        with phases("version"):
            self.client.set_weight_version(version)

    def _forget_old_prompts(self, phases: _Phases) -> None:
        """``none``: drop the old weights' prompt KV (vLLM refuses while requests hold it)."""
        if self.cfg.pause_mode == "none" and not self.salted:
            with phases("cache"):
                self.client.reset_prefix_cache()

    def _reload(self, phases: _Phases) -> None:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="grpo_nb_weights_"))
        # safetensors from the state dict: what vLLM's loader reads, without config files.
        from safetensors.torch import save_file

        with phases("transfer"):
            state = {k: v.detach().to("cpu").contiguous()
                     for k, v in self.model.state_dict().items()}
            if getattr(self.model.config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)
            save_file(state, str(self._tmp / "model.safetensors"))
        with phases("load"):
            self.client.collective_rpc("reload_weights", {"weights_path": str(self._tmp)},
                                       timeout=self.cfg.timeout_s)

    # ── verification ──

    def probe(self) -> list[list[int]]:
        """Fixed token sequences whose log-probs both sides compute (seeded, model's vocab)."""
        vocab = int(self.model.config.vocab_size)
        gen = torch.Generator().manual_seed(1234)
        return torch.randint(0, vocab, (self.cfg.probe_batch, self.cfg.probe_len),
                             generator=gen).tolist()

    def server_logprobs(self, ids: list[list[int]]) -> torch.Tensor:
        """``[N, L-1]`` log-probs the server assigns to each probe token given its prefix."""
        if self._model_name is None:
            self._model_name = self.client.model_name()
        rows = []
        for seq in ids:
            body = {"model": self._model_name, "prompt": seq, "max_tokens": 1,
                    "temperature": 0.0, "prompt_logprobs": 0}
            choice = self.client.completions(body)["choices"][0]
            entries = choice.get("prompt_logprobs") or []
            if len(entries) != len(seq):
                raise WeightSyncError(f"server returned {len(entries)} prompt log-probs for a "
                                      f"{len(seq)}-token probe")
            rows.append([float(entries[i][str(tok)]["logprob"])
                         for i, tok in enumerate(seq) if i > 0])
        return torch.tensor(rows, dtype=torch.float64)

    @torch.no_grad()
    def trainer_logprobs(self, ids: list[list[int]]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        x = torch.tensor(ids, device=device)
        logits = self.model(input_ids=x).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, x[:, 1:, None])
        return logp.squeeze(-1).double().cpu()

    def weight_gap(self) -> float:
        """Largest |log-prob difference| between server and trainer on the probe."""
        ids = self.probe()
        return float((self.server_logprobs(ids) - self.trainer_logprobs(ids)).abs().max())

    def verify(self, version: int | None = None) -> bool:
        """Raise unless the server serves the trainer's weights (and weight ``version``).

        The proof is behavioural: the server's log-probs of fixed probe sequences must equal
        the trainer's to within ``atol`` (float32 on both sides agrees to ~1e-5; one optimiser
        step moves them by far more). Comparing raw tensors is not possible on CPU, where
        vLLM repacks linear weights into its own layout.
        """
        gap = self.weight_gap()
        self.last_gap = gap
        if not gap <= self.cfg.atol:
            raise WeightSyncError(f"served weights differ from the trainer's: probe log-probs "
                                  f"differ by up to {gap:.3g} (> atol={self.cfg.atol})")
        if version is not None:
            served_version = self.client.weight_version()
            if served_version != str(version):
                raise WeightSyncError(f"server reports weight version {served_version!r}, "
                                      f"expected {str(version)!r}")
        return True
