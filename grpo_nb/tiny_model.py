"""Build a tiny Qwen3 model and its character tokenizer locally, warm-started on arithmetic.

No model hub is needed: the tokenizer is built with ``tokenizers``, the model is a
``Qwen3ForCausalLM`` from ``transformers`` (the architecture vLLM serves for real Qwen3
checkpoints), and a short supervised fine-tune (SFT) teaches it the task *partly*::

    TinyModelConfig ──key()──► <cache>/models/tiny-qwen3-<key>/   (cached: built once)
          │                          ▲
          ├─ char tokenizer ─────────┤ tokenizer.json, tokenizer_config.json
          ├─ Qwen3Config ─► model ─┐ │
          └─ tasks.make_dataset ───┴─► SFT until greedy test accuracy ≥ target
                                     └ model.safetensors, config.json, grpo_nb_meta.json

Why stop at 20–50 % accuracy: GRPO learns from groups whose samples disagree. A model that is
always wrong (or always right) gives groups of equal rewards, whose advantages are all zero.
Accuracy under SFT jumps suddenly, so SFT stops on an accuracy target measured often, not
after a fixed number of steps.

Vocabulary: 32 tokens — ``<pad> <eos> <unk>``, the ten digits, ``+ - =``, space, and reserved
slots up to 32 — and the tokenizer's size equals the model's ``vocab_size`` (vLLM decodes an
id past the tokenizer to ``""``).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grpo_nb.config import cache_dir
from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset

SPECIALS = ("<pad>", "<eos>", "<unk>")
CHARS = tuple("0123456789+-= ")
VOCAB_SIZE = 32
_FORMAT_VERSION = 2  # bump when the build recipe changes, so old caches are not reused


@dataclass
class TinyModelConfig:
    """Architecture, warm-start recipe and task of the tiny model (all part of the cache key).

    The architecture (≈ 0.3M parameters) is sized for a 2-core CPU. SFT draws a fresh batch
    of ``batch_size`` problems every step (never a test problem), AdamW with ``lr`` after a
    linear warm-up of ``warmup_steps``, until greedy accuracy on ``eval_size`` test problems
    reaches ``target_acc`` (checked every ``eval_every`` steps, and after *every* step once
    accuracy passes ``dense_eval_from``: it can climb 25 points in ten steps), at most
    ``max_steps`` steps. The high ``lr`` with its warm-up is what lets accuracy take off within
    a few hundred steps; a lower one without warm-up leaves it at 0 % for thousands.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 32
    num_kv_heads: int = 2
    ffn_size: int = 256
    max_position_embeddings: int = 512
    task: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    lr: float = 1e-2
    warmup_steps: int = 100
    batch_size: int = 128
    target_acc: float = 0.30
    eval_every: int = 10
    dense_eval_from: float = 0.05
    eval_size: int = 256
    max_steps: int = 3_000
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.task, dict):
            self.task = ArithmeticTaskConfig(**self.task)
        for name in ("hidden_size", "num_layers", "num_heads", "head_dim", "num_kv_heads",
                     "ffn_size", "batch_size", "eval_every", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyModelConfig.{name}={getattr(self, name)}: must be ≥ 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TinyModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if not 0.0 <= self.target_acc <= 1.0:
            raise ValueError(f"TinyModelConfig.target_acc={self.target_acc}: use 0..1")
        if self.max_steps < 0:
            raise ValueError(f"TinyModelConfig.max_steps={self.max_steps}: must be ≥ 0")
        if self.task.ops != ("+",):
            raise ValueError(f"TinyModelConfig.task.ops={self.task.ops}: the warm start "
                             "supports additions only (fixed-length answers)")
        if self.warmup_steps < 0:
            raise ValueError(f"TinyModelConfig.warmup_steps={self.warmup_steps}: must be ≥ 0")
        if self.lr <= 0:
            raise ValueError(f"TinyModelConfig.lr={self.lr}: must be > 0")

    @classmethod
    def smoke(cls) -> TinyModelConfig:
        """The same model as the full preset: the warm start is what makes GRPO work at all."""
        return cls()

    def key(self) -> str:
        """A short hash of everything that changes the built files."""
        blob = json.dumps({"v": _FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_dir(cfg: TinyModelConfig) -> Path:
    return cache_dir() / "models" / f"tiny-qwen3-{cfg.key()}"


def build_tokenizer() -> Any:
    """A character-level fast tokenizer of exactly :data:`VOCAB_SIZE` tokens, no chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reserved = tuple(f"<r{i}>" for i in range(VOCAB_SIZE - len(SPECIALS) - len(CHARS)))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS + reserved)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters without the spaces WordLevel would add
    core.add_special_tokens(list(SPECIALS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    if len(tok) != VOCAB_SIZE:
        raise AssertionError(f"tokenizer has {len(tok)} tokens, expected {VOCAB_SIZE}")
    return tok


def build_model(cfg: TinyModelConfig, tokenizer: Any) -> Any:
    """A randomly initialised ``Qwen3ForCausalLM`` (seeded by ``cfg.seed``)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,  # a separate lm_head is easier to inspect in weight sync
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(config)


def _encode_split(split: Any, tokenizer: Any) -> tuple[Any, Any]:
    """``(prompt_ids [N, P], answer_ids_with_eos [N, A])``; every row has the same lengths."""
    import torch

    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in split["prompt"]]
    answers = [tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id]
               for a in split["answer"]]
    if len({len(p) for p in prompts}) != 1 or len({len(a) for a in answers}) != 1:
        raise ValueError("the tiny model's SFT expects fixed-length prompts and answers "
                         "(zero-padded, additions only)")
    return torch.tensor(prompts), torch.tensor(answers)


def greedy_accuracy(model: Any, prompt_ids: Any, answer_ids: Any, batch: int = 1024) -> float:
    """Fraction of prompts whose greedy continuation is exactly the answer then ``<eos>``.

    Computed in one teacher-forced pass: greedy decoding reproduces the answer exactly when,
    and only when, the argmax at every answer position (given the correct prefix) is the
    correct token. That is ~5× cheaper than decoding token by token, which matters because
    SFT evaluates often.
    """
    import torch

    was_training = model.training
    model.eval()
    correct, p = 0, prompt_ids.shape[1]
    with torch.no_grad():
        for start in range(0, len(prompt_ids), batch):
            want = answer_ids[start : start + batch]
            seq = torch.cat([prompt_ids[start : start + batch], want[:, :-1]], dim=1)
            pred = model(input_ids=seq, use_cache=False).logits[:, p - 1 :].argmax(-1)
            correct += int((pred == want).all(dim=1).sum())
    model.train(was_training)
    return correct / len(prompt_ids)


def _digit_ids(x: Any, n: int, tokenizer: Any) -> Any:
    """``[B] ints → [B, n]`` token ids of their zero-padded decimal digits."""
    import torch

    zero = tokenizer.convert_tokens_to_ids("0")  # digits are consecutive ids
    return torch.stack([(x // 10**k) % 10 for k in reversed(range(n))], dim=1) + zero


def _fresh_batch(cfg: TinyModelConfig, tokenizer: Any, gen: Any, excluded: Any) -> tuple[Any, Any]:
    """A new batch of additions (none from the test split): ``(input_ids, labels)``."""
    import torch

    d, size = cfg.task.digits, 10**cfg.task.digits
    a = torch.randint(0, size, (2 * cfg.batch_size,), generator=gen)
    b = torch.randint(0, size, (2 * cfg.batch_size,), generator=gen)
    keep = ~excluded[a * size + b]
    a, b = a[keep][: cfg.batch_size], b[keep][: cfg.batch_size]
    col = lambda tok: torch.full((len(a), 1), tokenizer.convert_tokens_to_ids(tok))  # noqa: E731
    seqs = torch.cat([_digit_ids(a, d, tokenizer), col("+"), _digit_ids(b, d, tokenizer),
                      col("="), _digit_ids(a + b, d + 1, tokenizer), col("<eos>")], dim=1)
    labels = seqs.clone()
    labels[:, : 2 * d + 2] = -100  # loss on the answer and <eos> only
    return seqs, labels


def _sft(cfg: TinyModelConfig, model: Any, tokenizer: Any, progress: bool) -> dict[str, Any]:
    """Supervised warm start; returns a summary (steps, accuracy, time)."""
    import torch
    from tqdm.auto import tqdm

    test = make_dataset(cfg.task)["test"]
    test_p, test_a = _encode_split(test, tokenizer)
    eval_p, eval_a = test_p[: cfg.eval_size], test_a[: cfg.eval_size]
    size = 10**cfg.task.digits
    excluded = torch.zeros(size * size, dtype=torch.bool)
    excluded[torch.tensor(test["a"]) * size + torch.tensor(test["b"])] = True

    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    warmup = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    model.train()
    t0, acc, step, history = time.perf_counter(), 0.0, 0, []
    bar = tqdm(total=cfg.max_steps, desc="SFT warm start", disable=not progress, leave=False)
    try:
        while step < cfg.max_steps:
            seqs, labels = _fresh_batch(cfg, tokenizer, gen, excluded)
            loss = model(input_ids=seqs, labels=labels, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            warmup.step()
            step += 1
            bar.update(1)
            if acc >= cfg.dense_eval_from or step % cfg.eval_every == 0:
                acc = greedy_accuracy(model, eval_p, eval_a)
                history.append((step, acc))
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.0%}")
                if acc >= cfg.target_acc:
                    break
    finally:
        bar.close()
    return {
        "steps": step,
        "eval_accuracy": acc,
        "test_accuracy": greedy_accuracy(model, test_p, test_a),
        "sft_seconds": round(time.perf_counter() - t0, 2),
        "history": history,
    }


@contextlib.contextmanager
def _lock(path: Path):
    """Only one process builds a given model; the others wait, then load the result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build(cfg: TinyModelConfig, out_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """Build tokenizer + model, warm-start it, and ``save_pretrained`` both into ``out_dir``."""
    import torch
    from transformers import GenerationConfig

    tokenizer = build_tokenizer()
    threads = torch.get_num_threads()
    # One thread: the same seed gives the same weights on any machine (float reductions
    # depend on the thread count), and tiny matmuls gain little from a second core.
    torch.set_num_threads(1)
    try:
        model = build_model(cfg, tokenizer)
        summary = _sft(cfg, model, tokenizer, progress)
    finally:
        torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta = {
        "config": asdict(cfg),
        "key": cfg.key(),
        "params": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        **summary,
    }
    (out_dir / "grpo_nb_meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def build_or_load(cfg: TinyModelConfig | None = None, *, progress: bool = True,
                  out_dir: Path | str | None = None) -> Path:
    """The folder of the tiny model for ``cfg``: built on first use, then loaded from cache.

    The folder loads with ``AutoModelForCausalLM.from_pretrained`` /
    ``AutoTokenizer.from_pretrained`` and with ``vllm serve``. A build writes into a temporary
    sibling folder and renames it at the end, so an interrupted build never leaves a folder
    that looks finished.
    """
    cfg = cfg or TinyModelConfig()
    final = Path(out_dir) if out_dir is not None else default_dir(cfg)
    if (final / "grpo_nb_meta.json").is_file():
        return final
    with _lock(final.with_name(final.name + ".lock")):
        if (final / "grpo_nb_meta.json").is_file():  # another process built it meanwhile
            return final
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            build(cfg, tmp, progress=progress)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def is_tiny_model(model: Path | str | None) -> bool:
    """Whether ``model`` is this module's tiny character model: ``None`` (built or loaded
    from the cache on demand) or a folder :func:`build_or_load` wrote."""
    return model is None or (Path(model).expanduser() / "grpo_nb_meta.json").is_file()


def load_meta(model_dir: Path | str) -> dict[str, Any]:
    """The build summary saved next to a tiny model (accuracy, steps, time, config)."""
    return json.loads((Path(model_dir) / "grpo_nb_meta.json").read_text())


def load_hf(model_dir: Path | str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` with transformers, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def clone_config(cfg: TinyModelConfig, **changes: Any) -> TinyModelConfig:
    """A copy of ``cfg`` with some fields changed (validated again)."""
    data = copy.deepcopy(asdict(cfg))
    data.update(changes)
    return TinyModelConfig(**data)
