"""Push the trainer's weights into a running vLLM server, and prove they arrived.

One :class:`WeightSyncer` per (trainer model, server). Each :meth:`WeightSyncer.sync` runs
vLLM's own weight-update flow and sets a new weight version on the server::

    sync(version)
      ├─ /pause?mode=keep|wait|abort      (why pause: no token is sampled from half-new weights)
      ├─ transport
      │    gloo   : vLLM WeightTransferTrainerFactory → our gloo engine (start/update/finish)
      │    nccl   : the same factory → vLLM's NCCL engine (trainer and server on 2 GPUs)
      │    ipc    : the same factory → vLLM's CUDA-IPC engine (trainer and server share a GPU)
      │    reload : save safetensors → /collective_rpc reload_weights(weights_path=DIR)
      ├─ weight version := str(version)
      ├─ /resume                          (always, in ``finally``)
      └─ verify (optional): server's probe log-probs == trainer's, version matches

Pause modes. ``keep`` freezes in-flight requests and continues them on the new weights (their
early tokens came from the old policy: staleness *within* a sample, which the importance
ratio against the sampler's logprobs accounts for). ``wait`` lets them finish first (the sync
waits for the longest request). ``abort`` ends them with ``finish_reason="abort"`` (the
generator must drop or retry them).

Any failure raises :class:`WeightSyncError`; the caller's version must not advance then.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from grpo_nb.serving.server import free_port
from grpo_nb.weight_sync.client import VLLMControlClient, WeightSyncError

Transport = Literal["gloo", "reload", "nccl", "ipc"]
PauseMode = Literal["keep", "wait", "abort"]
EXTENSION = "grpo_nb.weight_sync.worker.GrpoWorkerExtension"


@dataclass
class WeightSyncConfig:
    """How weights travel to the server.

    Args:
        transport: ``gloo`` (CPU, our engine), ``reload`` (CPU, from disk), ``nccl`` (GPU,
            one per side) or ``ipc`` (GPU shared by trainer and server).
        pause_mode: what happens to in-flight requests during a sync (see module docstring).
        verify: after each sync, check that the served weights equal the trainer's.
        chunk_mb: packed buffer size on the wire (gloo).
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
        if self.pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"WeightSyncConfig.pause_mode={self.pause_mode!r}: "
                             "use 'keep', 'wait' or 'abort'")
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
    """What one sync did: the version now served, its duration and size, and the check."""

    version: int
    ms: float
    bytes: int
    verified: bool | None  # None: not checked


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class WeightSyncer:
    """Trainer side of weight sync for one model and one server (see module docstring)."""

    def __init__(self, url: str, model: torch.nn.Module,
                 cfg: WeightSyncConfig | None = None) -> None:
        self.cfg = cfg or WeightSyncConfig()
        self.model = model
        self.client = VLLMControlClient(url, timeout=self.cfg.timeout_s)
        self.engine: Any = None
        self.version: int | None = None  # last version the server confirmed
        self._tmp: Path | None = None
        self._model_name: str | None = None
        self.last_gap: float | None = None

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
            info: Any = GlooTrainerInitInfo("127.0.0.1", free_port(), 2,
                                            chunk_bytes=self.cfg.chunk_mb << 20,
                                            timeout_s=self.cfg.timeout_s, rank=0)
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
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.shutdown()
            self.engine = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

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
        self.connect()
        start = time.perf_counter()
        paused = False
        try:
            self.client.pause(self.cfg.pause_mode)
            paused = True
            if self.cfg.transport == "reload":
                self._reload(str(version))
            else:
                self.engine.weight_version = str(version)  # ours sends it with "finish"
                self.engine.send_weights()
                if self.cfg.transport != "gloo":  # vLLM's engines finish without a version
                    self.client.set_weight_version(str(version))
        except WeightSyncError:
            raise
        except Exception as err:
            raise WeightSyncError(f"weight sync to version {version} failed: "
                                  f"{type(err).__name__}: {err}") from err
        finally:
            if paused:
                self.client.resume()
        ms = (time.perf_counter() - start) * 1e3
        verified = self.verify(version) if (self.cfg.verify if verify is None else verify) else None
        self.version = version
        return SyncResult(version, ms, model_bytes(self.model), verified)

    def _reload(self, version: str) -> None:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="grpo_nb_weights_"))
        # safetensors from the state dict: what vLLM's loader reads, without config files.
        from safetensors.torch import save_file

        state = {k: v.detach().to("cpu").contiguous()
                 for k, v in self.model.state_dict().items()}
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(self._tmp / "model.safetensors"))
        self.client.collective_rpc("reload_weights", {"weights_path": str(self._tmp)},
                                   timeout=self.cfg.timeout_s)
        self.client.set_weight_version(version)

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
