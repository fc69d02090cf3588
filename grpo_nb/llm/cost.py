"""A cost model of one GRPO step (generate G, train T, sync S), checked against a run's own
metric rows: sync mode G + T + S; async max(G, T) + S, or max(G + S_server, T + S) when a sync
does not pause the server. ``busy`` rows are not read, so a recorded run gives the same numbers."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, median
from typing import Any

Row = Mapping[str, Any]
_KINDS = ("step", "sync", "eval", "skipped")  # the rows the model reads
SERVER_PHASES = ("start", "wait", "load", "finish")  # a sync's phases inside the engine


@dataclass(frozen=True)
class StepPhases:
    """Mean per-step seconds over a run's steady steps (``step`` = ``wait`` + ``train`` +
    ``sync``); ``generate``: first request to last group in (G in sync mode only)."""

    steps: int
    step: float
    wait: float
    train: float
    sync: float
    generate: float
    server_sync: float = 0.0


@dataclass(frozen=True)
class Prediction:
    """Step times (seconds) and speed-ups predicted from sync-mode phases G, T, S."""

    G: float
    T: float
    S: float
    S_server: float
    sync_step: float
    async_step: float
    overlap_bound: float
    model_speedup: float


def _steady(rows: Iterable[Row], checkpoint_every: int | None
            ) -> Iterator[tuple[Row, Row, list[Row]]]:
    """Each steady step (no eval, skip or checkpoint) as (previous row, its row, rows between)."""
    rows = sorted((r for r in rows if r["kind"] in _KINDS), key=lambda r: r["t"])
    steps = [r for r in rows if r["kind"] == "step"]
    for prev, cur in zip(steps, steps[1:], strict=False):
        inside = [r for r in rows if prev["t"] < r["t"] <= cur["t"]]
        if any(r["kind"] in ("eval", "skipped") for r in inside):
            continue
        if checkpoint_every and prev["step"] % checkpoint_every == 0:
            continue
        yield prev, cur, inside


def steady_intervals(rows: Iterable[Row], checkpoint_every: int | None = None
                     ) -> list[dict[str, float]]:
    """One dict of seconds per steady step (``step``, ``train``, ``sync``, ``generate`` …)."""
    out: list[dict[str, float]] = []
    for prev, cur, inside in _steady(rows, checkpoint_every):
        syncs = [r for r in inside if r["kind"] == "sync"]
        server = sum(r.get("phases", {}).get(k, 0.0) for r in syncs for k in SERVER_PHASES)
        train = float(cur["train_s"])
        out.append({"step": cur["t"] - prev["t"], "train": train,
                    "sync": sum(r["ms"] for r in syncs) / 1000.0, "server_sync": server / 1000.0,
                    "generate": max(cur["age_s"]) - train})
    return out


def steady_sync_phases(rows: Iterable[Row], checkpoint_every: int | None = None
                       ) -> dict[str, float]:
    """Median ms of each sync phase over the syncs inside :func:`steady_intervals`' steps."""
    syncs = [r["phases"] for _, _, inside in _steady(rows, checkpoint_every)
             for r in inside if r["kind"] == "sync" and r.get("phases")]
    names = sorted({k for ph in syncs for k in ph})
    return {k: median(ph.get(k, 0.0) for ph in syncs) for k in names}


def step_phases(rows: Iterable[Row], checkpoint_every: int | None = None) -> StepPhases:
    """The mean of :func:`steady_intervals` (``ValueError`` when a run has none)."""
    ivs = steady_intervals(rows, checkpoint_every)
    if not ivs:
        raise ValueError("no steady step in these rows: a run needs at least 2 steps outside "
                         "evals and checkpoints")
    mean = {k: fmean(iv[k] for iv in ivs) for k in ivs[0]}
    return StepPhases(steps=len(ivs), wait=mean["step"] - mean["train"] - mean["sync"], **mean)


def predict(sync_run: StepPhases, *, paused: bool = True) -> Prediction:
    """Both modes' step times from the sync run's phases; ``paused``: a sync stops generation
    (every pause mode but ``"none"``). ``overlap_bound`` = (G + T + S) / max(G, T + S)."""
    g, t, s, s_server = sync_run.generate, sync_run.train, sync_run.sync, sync_run.server_sync
    sync_step = g + t + s
    async_step = max(g, t) + s if paused else max(g + s_server, t + s)
    return Prediction(G=g, T=t, S=s, S_server=s_server, sync_step=sync_step,
                      async_step=async_step,
                      overlap_bound=sync_step / max(g, t + s),
                      model_speedup=sync_step / async_step)


def run_pause_mode(run_dir: str | Path) -> str:
    """The pause mode a run's syncs used (its ``config.json``; ``"keep"`` if it names none)."""
    config = json.loads((Path(run_dir) / "config.json").read_text())
    return str(config.get("sync", {}).get("pause_mode", "keep"))


def loop_seconds(rows: Iterable[Row]) -> float:
    """The training loop's wall time, the first step's start to the last step's end."""
    steps = [r for r in rows if r["kind"] == "step"]
    return steps[-1]["t"] - (steps[0]["t"] - steps[0]["wall_s"]) if steps else 0.0


class OtherLoad:
    """The CPU seconds the rest of the machine used while a ``with`` block ran: the machine's
    busy time (``psutil.cpu_times``) less this process tree's (this process, its reaped
    children and its live descendants, e.g. a vLLM server it started). ``cores`` is that over
    the block's wall time. The model assumes the ring has the machine's cores to itself."""

    cores: float = 0.0  # the rest of the machine's CPU seconds per wall second
    other_s: float = 0.0  # the rest of the machine's CPU seconds during the block
    ours_s: float = 0.0  # this process tree's CPU seconds during the block

    @staticmethod
    def _read() -> tuple[float, float, float]:
        import psutil  # here: the GPU probe imports this module on an image without psutil

        machine = psutil.cpu_times()
        # guest time is counted in user time too; steal (the host's other guests) is counted:
        # it is time these cores were not ours
        idle = ("idle", "iowait", "guest", "guest_nice")
        busy = sum(machine) - sum(getattr(machine, k, 0.0) for k in idle)
        me = psutil.Process()
        own = me.cpu_times()
        ours = own.user + own.system + own.children_user + own.children_system
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                ours += sum(child.cpu_times()[:2])
        return time.monotonic(), busy, ours

    def __enter__(self) -> OtherLoad:
        self._start = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        (t0, busy0, ours0), (t1, busy1, ours1) = self._start, self._read()
        self.ours_s = ours1 - ours0
        self.other_s = max(0.0, (busy1 - busy0) - self.ours_s)
        self.cores = self.other_s / max(t1 - t0, 1e-9)


# --- GPU memory of the single-GPU plan (trainer and vLLM server on one card), from shapes ---

GIB = 1 << 30
KV_MARGIN = 1.2  # KV cache a server gets over its in-flight sequences at full context
KV_EXTRA_SEQS = 64  # sequences beyond the generators' requests: evaluation and probes
# vLLM's memory besides weights and KV cache (CUDA context, its profile run's activations and
# the sampler's float32 logits, CUDA graphs): an estimate; gpu_check.py --probe measures it
SERVER_OVERHEAD = 2 * GIB
TRAINER_CONTEXT = GIB // 2  # the trainer process's CUDA context and kernels
TRAINER_MARGIN = 1.1  # the caching allocator's rounding and fragmentation over the counted peak
CARDS_GB = (24, 48, 80, 141)  # decimal GB (1e9 B): a card's usable memory is at least that
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The fields of a Qwen3-style decoder's ``config.json`` that decide its memory."""

    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = True  # lm_head shares the embedding (one matrix, counted once)

    @classmethod
    def from_hf(cls, c: Mapping[str, Any]) -> ModelShape:
        c = c.get("text_config", c)
        heads = c["num_attention_heads"]
        return cls(hidden=c["hidden_size"], layers=c["num_hidden_layers"], vocab=c["vocab_size"],
                   heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   intermediate=c.get("intermediate_size", 4 * c["hidden_size"]),
                   tied=bool(c.get("tie_word_embeddings", True)))

    @property
    def params(self) -> int:
        """Parameters: embedding (and an untied head), per layer q/k/v/o, gate/up/down, two
        RMSNorms and the q/k norms, and the final norm."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = 2 * h * q + 2 * h * kv + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of every layer for one token (Qwen3-0.6B in bf16: 114,688 B)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * _DTYPE_BYTES[dtype]

    def layer_saved_per_token(self) -> int:
        """Bytes one decoder layer saves for its backward per token under bf16 autocast (counted
        with ``torch.autograd.graph.saved_tensors_hooks``, SDPA without a padding mask: float32
        norm inputs and outputs, bf16 projection inputs and outputs, attention's q, k, v,
        output and per-head log-sum-exp; tests/test_cost.py recounts it)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (26 * self.hidden + 8 * self.intermediate + 10 * q + 10 * kv
                + 8 * self.heads + 4 * self.kv_heads + 8)


QWEN3 = {  # the Qwen3 family's config.json fields
    "Qwen3-0.6B": ModelShape(1024, 28, 151936, 16, 8, 128, 3072),
    "Qwen3-1.7B": ModelShape(2048, 28, 151936, 16, 8, 128, 6144),
    "Qwen3-4B": ModelShape(2560, 36, 151936, 32, 8, 128, 9728),
    "Qwen3-8B": ModelShape(4096, 36, 151936, 32, 8, 128, 12288, tied=False)}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of one GPU holding the trainer (float32 masters, AdamW, bf16 autocast, gradient
    checkpointing, chunked log-probs) and the vLLM server; ``*_terms`` name each part."""

    trainer_terms: dict[str, int]
    server_terms: dict[str, int]

    @property
    def trainer_peak(self) -> int:
        return sum(self.trainer_terms.values())

    @property
    def server_need(self) -> int:
        return sum(self.server_terms.values())

    def fits(self, card_bytes: int) -> bool:
        """Trainer peak (with ``TRAINER_MARGIN``) beside the server's share, on one card."""
        share = server_fraction(self.server_need, card_bytes) * card_bytes
        return share + TRAINER_MARGIN * self.trainer_peak <= card_bytes


def server_fraction(need_bytes: int, card_bytes: int) -> float:
    """A server's ``gpu_memory_utilization`` on a card: its need, rounded up to 0.01."""
    return math.ceil(100 * need_bytes / card_bytes) / 100


def server_terms(shape: ModelShape, server_seqs: int, context: int, dtype: str
                 ) -> dict[str, int]:
    """vLLM's need: weights in ``dtype``, and a KV cache for ``server_seqs`` requests in flight
    (+ ``KV_EXTRA_SEQS``) at ``context`` tokens each, times ``KV_MARGIN``; ``SERVER_OVERHEAD``."""
    kv = KV_MARGIN * (server_seqs + KV_EXTRA_SEQS) * context * shape.kv_bytes_per_token(dtype)
    return {"weights": _DTYPE_BYTES[dtype] * shape.params, "kv_cache": int(kv),
            "overhead": SERVER_OVERHEAD}


def memory_plan(shape: ModelShape, *, sequences: int, prompt_len: int, completion_len: int,
                server_seqs: int, serve_dtype: str = "bfloat16") -> MemoryPlan:
    """The single-GPU plan's memory for ``sequences`` of ``prompt_len + completion_len`` tokens
    in one micro-batch, and a server with ``server_seqs`` requests in flight.

    Trainer: 12 B a parameter always (float32 weights, AdamW's two moments), the residual
    stream's float32 checkpoints (each layer's input and the final norm's), then the larger of
    the forward's end (bf16 copies of every weight in autocast's cache, the log-prob head's
    chunk) and backward (float32 gradients, one layer recomputed, or the head's chunk and its
    weight's float32 gradient and bf16 copy), and the 4-D float32 padding mask."""
    from grpo_nb.logprobs import default_chunk

    p, h, v = shape.params, shape.hidden, shape.vocab
    context = prompt_len + completion_len
    tokens = sequences * context
    rows = sequences * completion_len  # the completion positions the head scores
    chunk = min(default_chunk(v), rows) * v  # logits of one chunk
    residual = (shape.layers + 1) * tokens * h * 4
    forward = 2 * p + 10 * chunk  # bf16 weights; bf16 logits, float32 scores and probs
    layer = tokens * (shape.layer_saved_per_token() + 8 * h)  # + the residual's two gradients
    head = 6 * v * h + 8 * chunk  # float32 gradient + bf16 copy; float32 scores, two bf16
    trainer = {"weights_adam": 12 * p, "checkpoints": residual,
               "peak_phase": max(forward, 4 * p + max(layer, head)),
               "head_rows": 2 * rows * h * 4, "mask": 4 * sequences * context ** 2,
               "context": TRAINER_CONTEXT}
    return MemoryPlan(trainer, server_terms(shape, server_seqs, context, serve_dtype))


def memory_rows() -> list[str]:
    """README's memory table (``| model | batch | trainer peak | server | 24 | 48 | 80 | 141 |``):
    the GPU run's batch (8 prompts) and the CLI default's (16), 8 completions, 256 + 256 tokens,
    2 generators × 64 requests in flight."""
    out = []
    for name, shape in QWEN3.items():
        for prompts in (8, 16):
            plan = memory_plan(shape, sequences=prompts * 8, prompt_len=256, completion_len=256,
                               server_seqs=2 * 64)
            fits = ["yes" if plan.fits(int(gb * 1e9)) else "no" for gb in CARDS_GB]
            out.append(f"| {name} | {prompts} × 8 × (256 + 256) | "
                       f"{plan.trainer_peak / GIB:.1f} GiB | {plan.server_need / GIB:.1f} GiB | "
                       + " | ".join(fits) + " |")
    return out
