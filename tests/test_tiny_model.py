"""The tiny Qwen3 model: tokenizer, architecture, determinism, caching, warm-start accuracy."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from grpo_nb import tiny_model
from grpo_nb.llm.policy import load_policy
from grpo_nb.tiny_model import TinyModelConfig, build_or_load, build_tokenizer, load_meta


def test_tokenizer_is_char_level_and_matches_vocab():
    tok = build_tokenizer()
    assert len(tok) == tiny_model.VOCAB_SIZE
    ids = tok.encode("003+016=", add_special_tokens=False)
    assert len(ids) == 8
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "003+016="
    assert tok.decode(tok.encode("12 -3", add_special_tokens=False)) == "12 -3"
    assert tok.encode("x", add_special_tokens=False) == [tok.unk_token_id]


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="target_acc"):
        TinyModelConfig(target_acc=1.5)
    with pytest.raises(ValueError, match="hidden_size"):
        TinyModelConfig(hidden_size=0)


def test_cache_key_depends_on_config():
    a, b = TinyModelConfig(), TinyModelConfig(seed=1)
    assert a.key() == TinyModelConfig().key() != b.key()
    assert dataclasses.replace(a, seed=1).key() == b.key()


def test_build_is_deterministic_and_cached(tmp_path):
    """Two builds with the same seed give identical weights; a cached folder is reused."""
    cfg = TinyModelConfig(max_steps=6, eval_every=3, eval_size=32, batch_size=16, seed=5)
    first = build_or_load(cfg, progress=False, out_dir=tmp_path / "a")
    second = build_or_load(cfg, progress=False, out_dir=tmp_path / "b")
    wa, wb = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert build_or_load(cfg, progress=False, out_dir=first) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    other = build_or_load(dataclasses.replace(cfg, seed=6), progress=False,
                          out_dir=tmp_path / "c")
    wc = load_file(other / "model.safetensors")
    assert not torch.equal(wa["lm_head.weight"], wc["lm_head.weight"])
    assert not list(tmp_path.glob("*.tmp-*"))  # no half-built folders left


def test_warm_started_model_is_partly_right(tiny_model_dir):
    """The cached smoke model loads with transformers and solves some, not all, problems."""
    meta = load_meta(tiny_model_dir)
    model, tok = load_policy(tiny_model_dir)
    assert model.config.vocab_size == len(tok) == tiny_model.VOCAB_SIZE
    assert model.config.model_type == "qwen3"
    assert 0.15 <= meta["test_accuracy"] <= 0.65, meta["test_accuracy"]
    # Greedy decoding with transformers' own generate() agrees with the stored accuracy.
    from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset, make_reward

    rows = make_dataset(ArithmeticTaskConfig(**meta["config"]["task"]))["test"].select(range(200))
    enc = tok(list(rows["prompt"]), return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    reward = make_reward("math")
    acc = sum(reward(t, a) for t, a in zip(texts, rows["answer"], strict=True)) / len(rows)
    assert abs(acc - meta["test_accuracy"]) < 0.12, (acc, meta["test_accuracy"])


def test_teacher_forced_accuracy_is_exact_greedy_decoding_in_one_pass(tiny_model_dir):
    """A prompt counts exactly when greedy decoding writes its answer's tokens then ``<eos>``
    (``llm.rollouts.greedy_accuracy`` decodes on the server and scores the text instead)."""
    from types import SimpleNamespace

    from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset

    task = ArithmeticTaskConfig(**load_meta(tiny_model_dir)["config"]["task"])
    model, tok = load_policy(tiny_model_dir)
    rows = make_dataset(task)["test"].select(range(120))
    seqs, _ = tiny_model._additions(SimpleNamespace(task=task), tok, torch.tensor(rows["a"]),
                                    torch.tensor(rows["b"]))
    prompts, answers = seqs[:, : 2 * task.digits + 2], seqs[:, 2 * task.digits + 2:]
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                         max_new_tokens=answers.shape[1], eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, prompts.shape[1]:]
    decoded = [out[i].tolist() == answers[i].tolist() for i in range(len(rows))]
    forced = [tiny_model.teacher_forced_accuracy(model, prompts[i:i + 1], answers[i:i + 1]) == 1.0
              for i in range(len(rows))]
    assert forced == decoded and 0 < sum(decoded) < len(rows)
