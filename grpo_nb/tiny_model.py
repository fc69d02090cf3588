"""A tiny ``Qwen3ForCausalLM`` and its character tokenizer, built locally and cached by config
hash; a short SFT stops once it solves some additions, not all (GRPO needs groups that disagree).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch

from grpo_nb.config import Ge, Le, NonNegInt, PosFloat, PosInt, cache_dir, check_fields
from grpo_nb.partition import torch_settings
from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset

SPECIALS = ("<pad>", "<eos>", "<unk>")
CHARS = tuple("0123456789+-= ")
VOCAB_SIZE = 32  # also the model's vocab_size (vLLM decodes an id past the tokenizer to "")
_FORMAT_VERSION = 2  # bump when the build recipe changes, so old caches are not reused


@dataclass
class TinyModelConfig:
    """Architecture (sized for a 2-core CPU), warm-start recipe and task: all the cache key."""

    hidden_size: PosInt = 128  # the residual stream's width
    num_layers: PosInt = 2  # decoder layers
    num_heads: PosInt = 4  # query heads (a multiple of num_kv_heads)
    head_dim: PosInt = 32  # per head
    num_kv_heads: PosInt = 2  # key/value heads (grouped-query attention)
    ffn_size: PosInt = 256  # the MLP's hidden width
    max_position_embeddings: PosInt = 512  # the longest sequence (RoPE)
    task: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)  # what SFT teaches
    lr: PosFloat = 1e-2  # after a linear warm-up; lower stays at 0 % for thousands of steps
    warmup_steps: NonNegInt = 100  # of the linear warm-up
    batch_size: PosInt = 128  # problems per SFT step
    # SFT stops at this teacher_forced_accuracy on eval_size problems
    target_acc: Annotated[float, Ge(0), Le(1)] = 0.30
    eval_every: PosInt = 10  # SFT steps between evaluations
    dense_eval_from: float = 0.05  # from this accuracy on, evaluate after every step
    eval_size: PosInt = 256  # test problems per evaluation
    max_steps: NonNegInt = 3_000  # SFT steps at most
    seed: int = 0  # initialisation and batches

    def __post_init__(self) -> None:
        check_fields(self)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TinyModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.task.ops != ("+",):
            raise ValueError(f"TinyModelConfig.task.ops={self.task.ops}: the warm start "
                             "supports additions only (fixed-length answers)")

    @classmethod
    def smoke(cls) -> TinyModelConfig:
        """The same model as the full preset: the warm start is what makes GRPO work at all."""
        return cls()

    def key(self) -> str:
        blob = json.dumps({"v": _FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


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
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def build_model(cfg: TinyModelConfig, tokenizer: Any) -> Any:
    """A randomly initialised ``Qwen3ForCausalLM`` (seeded by ``cfg.seed``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,  # a separate lm_head is easier to inspect in weight sync
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(config)


def teacher_forced_accuracy(model: Any, prompt_ids: Any, answer_ids: Any,
                            batch: int = 1024) -> float:
    """Fraction of prompts whose answer tokens then ``<eos>`` are each the argmax after the
    prompt and the answer's earlier tokens (teacher forcing, one forward pass): the exact-token
    accuracy of greedy decoding, without decoding. Not ``llm.rollouts.greedy_accuracy``, which
    decodes on the server and scores the text with a reward."""
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


def _additions(cfg: TinyModelConfig, tokenizer: Any, a: Any, b: Any) -> tuple[Any, Any]:
    """``(input_ids, labels)`` of the problems ``a + b``, the loss on answer and ``<eos>`` only."""
    zero = tokenizer.convert_tokens_to_ids("0")  # digits are consecutive ids

    def digits(x: Any, n: int) -> Any:
        return torch.stack([(x // 10**k) % 10 for k in reversed(range(n))], dim=1) + zero

    def col(token: str) -> Any:
        return torch.full((len(a), 1), tokenizer.convert_tokens_to_ids(token))

    d = cfg.task.digits
    seqs = torch.cat([digits(a, d), col("+"), digits(b, d), col("="), digits(a + b, d + 1),
                      col("<eos>")], dim=1)
    labels = seqs.clone()
    labels[:, : 2 * d + 2] = -100
    return seqs, labels


def _sft(cfg: TinyModelConfig, model: Any, tokenizer: Any, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    test = make_dataset(cfg.task)["test"]
    a, b = torch.tensor(test["a"]), torch.tensor(test["b"])
    seqs, _ = _additions(cfg, tokenizer, a, b)
    test_p, test_a = seqs[:, : 2 * cfg.task.digits + 2], seqs[:, 2 * cfg.task.digits + 2 :]
    eval_p, eval_a = test_p[: cfg.eval_size], test_a[: cfg.eval_size]
    size = 10**cfg.task.digits
    excluded = torch.zeros(size * size, dtype=torch.bool)
    excluded[a * size + b] = True

    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    warmup = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    model.train()
    t0, acc, step, history = time.perf_counter(), 0.0, 0, []
    with tqdm(total=cfg.max_steps, desc="SFT warm start", disable=not progress, leave=False) as bar:
        while step < cfg.max_steps:
            # a fresh batch of additions, none from the test split
            a = torch.randint(0, size, (2 * cfg.batch_size,), generator=gen)
            b = torch.randint(0, size, (2 * cfg.batch_size,), generator=gen)
            keep = ~excluded[a * size + b]
            seqs, labels = _additions(cfg, tokenizer, a[keep][: cfg.batch_size],
                                      b[keep][: cfg.batch_size])
            loss = model(input_ids=seqs, labels=labels, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            warmup.step()
            step += 1
            bar.update(1)
            if acc >= cfg.dense_eval_from or step % cfg.eval_every == 0:
                acc = teacher_forced_accuracy(model, eval_p, eval_a)
                history.append((step, acc))
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.0%}")
                if acc >= cfg.target_acc:
                    break
    return {"steps": step, "eval_accuracy": acc, "history": history,
            "test_accuracy": teacher_forced_accuracy(model, test_p, test_a),
            "sft_seconds": round(time.perf_counter() - t0, 2)}


def build(cfg: TinyModelConfig, out_dir: Path, *, progress: bool = True) -> None:
    """Build the tokenizer and model, warm-start it, and save both into ``out_dir``."""
    from transformers import GenerationConfig

    tokenizer = build_tokenizer()
    # One thread: the same seed gives the same weights on any machine (float reductions
    # depend on the thread count), and tiny matmuls gain little from a second core.
    with torch_settings(threads=1):
        model = build_model(cfg, tokenizer)
        summary = _sft(cfg, model, tokenizer, progress)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta = {"config": asdict(cfg), "key": cfg.key(), "torch": torch.__version__,
            "params": sum(p.numel() for p in model.parameters()), **summary}
    (out_dir / "grpo_nb_meta.json").write_text(json.dumps(meta, indent=1))


def build_or_load(cfg: TinyModelConfig | None = None, *, progress: bool = True,
                  out_dir: Path | str | None = None) -> Path:
    """The folder of the tiny model for ``cfg``, built on first use by one process while others
    wait (into a sibling renamed at the end: an interrupted build never looks finished)."""
    cfg = cfg or TinyModelConfig()
    final = Path(out_dir or cache_dir() / "models" / f"tiny-qwen3-{cfg.key()}")
    if (final / "grpo_nb_meta.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with final.with_name(final.name + ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
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
    """Whether ``model`` is the tiny model: ``None`` (built on demand) or a folder it wrote."""
    return model is None or (Path(model).expanduser() / "grpo_nb_meta.json").is_file()


def load_meta(model_dir: Path | str) -> dict[str, Any]:
    """The build summary saved next to a tiny model (accuracy, steps, time, config)."""
    return json.loads((Path(model_dir) / "grpo_nb_meta.json").read_text())
