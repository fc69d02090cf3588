"""A realistic small model and GSM8K-format data, built offline: ``python tests/realistic_model.py OUT``.

Unlike the tiny character model, this one looks like a real Qwen3 checkpoint to every piece of
code that loads it: ``Qwen3ForCausalLM`` (tied embeddings, as Qwen3-0.6B), a byte-level BPE
``Qwen2Tokenizer`` trained here with ``tokenizers`` (a few hundred tokens), the special tokens
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` after the BPE vocabulary, a Qwen-style chat
template, and ``<|im_end|>`` as end-of-sequence. The weights are random: it is for plumbing
(tokenizer, template, vLLM, weight sync), not for accuracy. Layout::

    OUT/model/        config.json, generation_config.json (Qwen3's sampling defaults:
                      top_k 20, top_p 0.95, temperature 0.6), model.safetensors, tokenizer files
    OUT/gsm8k.jsonl   {"question": ..., "answer": "... <<3+4=7>>7 ...\\n#### 7"} per line
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5 / Qwen3's template without tools or thinking: one block per turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The sampling defaults Qwen3 folders ship in generation_config.json (Qwen3-0.6B's): vLLM
# applies them to every field a request leaves unset unless told otherwise.
QWEN3_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
NAMES = ("Tom", "Ana", "Liam", "Mei", "Sara", "Omar", "Nina", "Raj", "Zoe", "Ivan")
ITEMS = ("apples", "books", "stickers", "marbles", "pencils", "cookies", "stamps", "shells")


@dataclass(frozen=True)
class RealisticPaths:
    model_dir: Path
    data_file: Path


def word_problem(rng: random.Random) -> dict[str, str]:
    """One GSM8K-style row: a short story, calculator annotations, ``#### N`` at the end."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 30)
    kind = rng.choice(("add", "sub", "mul", "two_step"))
    if kind == "add":
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        c, steps = a + b, f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}."
    elif kind == "sub":
        a += b
        q = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
        c, steps = a - b, f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left."
    elif kind == "mul":
        a = a % 12 + 2
        q = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} is that?"
        c, steps = a * b, f"That is {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}."
    else:
        d = rng.randint(1, a + b)
        q = (f"{name} has {a} {item}, finds {b} more, then loses {d}. "
             f"How many {item} does {name} have?")
        c = a + b - d
        steps = (f"After finding some, {name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b}.\n"
                 f"After losing some, {a + b} - {d} = <<{a + b}-{d}={c}>>{c} {item}.")
    return {"question": q, "answer": f"{steps}\n#### {c}"}


def write_data(path: Path, rows: int = 300, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    data = [word_problem(rng) for _ in range(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return data


def build_tokenizer(corpus: list[str], bpe_vocab: int = 509) -> Any:
    """A Qwen2-style byte-level BPE tokenizer (same pre-tokenizer) trained on ``corpus``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=bpe_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                         show_progress=False)
    core.train_from_iterator(corpus, trainer)
    state = json.loads(core.to_str())["model"]
    vocab = dict(state["vocab"])
    for token in SPECIALS:  # after the BPE vocabulary, in Qwen's order
        vocab[token] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", unk_token=None, bos_token=None,
                         model_max_length=1024)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tokenizer: Any, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, seed: int = 0, dtype: str = "bfloat16") -> Any:
    """A random ``Qwen3ForCausalLM`` sized for ``tokenizer`` (head_dim 32: vLLM-CPU's smallest)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=32, max_position_embeddings=1024, rope_theta=1_000_000.0,
        tie_word_embeddings=True, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad],
                                               pad_token_id=pad, **QWEN3_SAMPLING)
    return model


def build(out_dir: str | Path, *, rows: int = 300, seed: int = 0,
          dtype: str = "bfloat16") -> RealisticPaths:
    """Write ``OUT/model`` and ``OUT/gsm8k.jsonl`` (a few seconds on a CPU)."""
    out = Path(out_dir)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    data_file = out / "gsm8k.jsonl"
    data = write_data(data_file, rows, seed)
    corpus = [f"{r['question']}\n{r['answer']}" for r in data]
    corpus += ["Solve the problem. Put the final answer in \\boxed{}.", "user", "assistant",
               "system", "You are a helpful assistant.", "0123456789 + - * / = \\boxed{}"]
    tokenizer = build_tokenizer(corpus)
    build_model(tokenizer, seed=seed, dtype=dtype).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return RealisticPaths(model_dir, data_file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rows", type=int, default=300, help="GSM8K-format rows to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args(argv)
    paths = build(args.out_dir, rows=args.rows, seed=args.seed, dtype=args.dtype)
    print(json.dumps({"model": str(paths.model_dir), "dataset": str(paths.data_file)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
