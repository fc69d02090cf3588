"""The realistic test model: Qwen3 + byte-level BPE + Qwen chat template, and its GSM8K data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from realistic_model import CHAT_TEMPLATE, SPECIALS, RealisticPaths, build, main

from grpo_nb import tasks


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> RealisticPaths:
    return build(tmp_path_factory.mktemp("realistic"), rows=120)


@pytest.fixture(scope="module")
def tokenizer(built: RealisticPaths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built.model_dir)


def test_tokenizer_is_byte_level_bpe_sized_like_the_model(built, tokenizer):
    from transformers import AutoConfig
    from transformers.models.qwen2 import Qwen2Tokenizer

    config = AutoConfig.from_pretrained(built.model_dir)
    assert isinstance(tokenizer, Qwen2Tokenizer)
    assert config.model_type == "qwen3" and config.tie_word_embeddings
    assert 256 < len(tokenizer) < 1000
    assert config.vocab_size == len(tokenizer)
    # The special tokens come after the BPE vocabulary, in Qwen's order.
    ids = tokenizer.convert_tokens_to_ids(list(SPECIALS))
    assert ids == list(range(len(tokenizer) - 3, len(tokenizer)))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == ids[2]
    assert config.eos_token_id == ids[2] and tokenizer.pad_token_id == ids[0]
    generation = json.loads((built.model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids[2], ids[0]]
    assert (built.model_dir / "model.safetensors").exists()


@pytest.mark.parametrize("text", [
    "Tom has 12 apples and gets 7 more. 12 + 7 = <<12+7=19>>19\n#### 19",
    "unseen: Zürich — naïve café 🙂 \\boxed{\\frac{1}{2}}", "",
])
def test_tokenizer_round_trips_any_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    if text.startswith("Tom"):
        assert len(ids) < len(text.encode()) / 1.5  # merges learned, not bytes alone


def test_chat_template_renders_qwen_style(built, tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    task = tasks.load_task(str(built.data_file), test_size=20, system_prompt="Be brief.")
    row = task.train[0]
    text = tasks.prompt_text(tokenizer, row)
    assert text == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{row['prompt']}"
                    "<|im_end|>\n<|im_start|>assistant\n")
    ids = tasks.render_prompt(tokenizer, row)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tokenizer.eos_token_id) == 2  # one per turn: the specials are single tokens
    assert tokenizer.decode(ids) == text


def test_data_file_is_gsm8k_and_scores(built):
    rows = [json.loads(line) for line in built.data_file.read_text().splitlines()]
    assert len(rows) == 120
    for row in rows:
        *_, last = re.findall(r"<<([^=]+)=(-?\d+)>>", row["answer"])
        assert eval(last[0]) == int(last[1])  # the calculator annotation is right
        assert row["answer"].endswith(f"#### {last[1]}")
    task = tasks.load_task(str(built.data_file), test_size=20, split_seed=3)
    assert (len(task.train), len(task.test)) == (100, 20)
    reward = tasks.make_reward("auto+0.1*format", default=task.default_reward)
    answer = task.test[0]["answer"]
    assert reward(f"Adding up gives \\boxed{{{answer}}}", answer) == pytest.approx(1.1)
    assert reward(f"So {answer} in total.", answer) == pytest.approx(1.0)
    assert reward(f"\\boxed{{{int(answer) + 1}}}", answer) == pytest.approx(0.1)


def test_model_loads_and_stops_at_im_end(built, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built.model_dir, dtype=torch.float32)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    ids = torch.tensor([tasks.render_prompt(tokenizer, {"prompt": "2+2?", "messages": [
        {"role": "user", "content": "2+2?"}]})])
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
        # Force <|im_end|>: generation must stop right there (it is the EOS).
        bias = torch.full((len(tokenizer),), -1e9)
        bias[tokenizer.eos_token_id] = 0
        out = model.generate(ids, max_new_tokens=5, do_sample=False,
                             logits_processor=[lambda _, scores: scores + bias])
    assert out[0, ids.shape[1]:].tolist() == [tokenizer.eos_token_id]


def test_cli_builds_into_any_folder(tmp_path: Path, capsys):
    assert main([str(tmp_path / "x"), "--rows", "10", "--dtype", "float32"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == {"model": str(tmp_path / "x" / "model"),
                       "dataset": str(tmp_path / "x" / "gsm8k.jsonl")}
    assert len(Path(printed["dataset"]).read_text().splitlines()) == 10
    config = json.loads((Path(printed["model"]) / "config.json").read_text())
    assert config["dtype"] == "float32"
