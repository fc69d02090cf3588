"""The offline arithmetic task, answer extraction, rewards and the hub-dataset loader."""

from __future__ import annotations

import json

import datasets
import pytest

from grpo_nb import tasks
from grpo_nb.tasks import ArithmeticTaskConfig, extract_answer, make_dataset, reward


def test_dataset_splits_are_disjoint_correct_and_seeded():
    cfg = ArithmeticTaskConfig(digits=2, ops=("+", "-"), n_train=300, n_test=50, seed=3)
    data = make_dataset(cfg)
    assert set(data) == {"train", "test"}
    assert (len(data["train"]), len(data["test"])) == (300, 50)
    train = {r["prompt"] for r in data["train"]}
    assert not train & {r["prompt"] for r in data["test"]}
    for row in data["train"]:
        value = row["a"] + row["b"] if row["op"] == "+" else row["a"] - row["b"]
        assert int(row["answer"]) == value
        assert row["prompt"] == f"{row['a']:02d}{row['op']}{row['b']:02d}="
        assert len(row["answer"].lstrip("-")) == 3  # zero-padded to digits + 1
    assert make_dataset(cfg)["test"]["prompt"] == data["test"]["prompt"]
    other = make_dataset(ArithmeticTaskConfig(digits=2, n_train=300, n_test=50, seed=4))
    assert other["test"]["prompt"] != data["test"]["prompt"]


def test_format_problem_pads_and_signs():
    assert tasks.format_problem(3, 6, "+", 3) == ("003+006=", "0009")
    assert tasks.format_problem(3, 16, "-", 2) == ("03-16=", "-013")


@pytest.mark.parametrize("kwargs, field", [
    ({"digits": 0}, "digits"), ({"ops": ("*",)}, "ops"), ({"n_test": 0}, "n_test"),
    ({"digits": 1, "n_train": 60}, "n_train"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticTaskConfig(**kwargs)


@pytest.mark.parametrize("text, expected", [
    ("0009", "0009"), (" 42 ", "42"), ("-013", "-013"),
    ("so the answer is \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("reasoning... #### 1,234", "1234"), ("first 3 then 7.5", "7.5"), ("no digits", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_reward_exact_numeric_and_format():
    assert reward("0009", "0009") == 1.0
    assert reward("9", "0009") == 1.0  # numeric equality, not string equality
    assert reward("0008", "0009") == 0.0
    assert reward("0009 12", "0009") == 0.0  # kept talking: the last number is what counts
    assert reward("", "0009") == 0.0
    assert reward("0008", "0009", format_weight=0.1) == pytest.approx(0.1)
    assert reward("0009", "0009", format_weight=0.1) == pytest.approx(1.1)
    assert reward("the sum is 9", "0009", format_weight=0.1) == pytest.approx(1.0)


def test_reward_uses_math_verify_for_latex():
    assert reward("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert reward("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}") == 0.0


def test_load_gsm8k_shape_from_jsonl(tmp_path):
    path = tmp_path / "gsm8k_test.jsonl"
    rows = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
            {"question": "Big?", "answer": "lots\n#### 1,200"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = tasks.load_hub_math(str(path), "test")
    assert data["answer"] == ["7", "1200"]
    assert data[0]["prompt"].startswith("Tom has 3 apples")
    assert tasks.HUB_INSTRUCTION in data[0]["prompt"]
    assert data[0]["messages"] == [{"role": "user", "content": data[0]["prompt"]}]
    assert reward("so \\boxed{1200}", data[1]["answer"]) == 1.0


def test_load_openr1_shape_from_parquet(tmp_path):
    path = tmp_path / "openr1.parquet"
    datasets.Dataset.from_list([
        {"problem": "Compute 1/2 + 0.", "solution": "...", "answer": "\\frac{1}{2}"},
    ]).to_parquet(str(path))
    data = tasks.load_hub_math(str(path), "train")
    assert data["answer"] == ["\\frac{1}{2}"]
    assert reward("\\boxed{0.5}", data[0]["answer"]) == 1.0


def test_load_hub_math_rejects_unknown_shapes(tmp_path):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps([{"text": "x"}]))
    with pytest.raises(ValueError, match="columns"):
        tasks.load_hub_math(str(path))
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n")
    with pytest.raises(ValueError, match="parquet"):
        tasks.load_hub_math(str(bad))


def test_render_prompt_plain_and_chat():
    class CharTok:
        chat_template = None

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    class ChatTok(CharTok):
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize and add_generation_prompt
            return {"input_ids": [1, 2] + self.encode(messages[0]["content"])}

    row = {"prompt": "1+2=", "answer": "3", "messages": [{"role": "user", "content": "hi"}]}
    assert tasks.render_prompt(CharTok(), row) == [ord(c) for c in "1+2="]
    assert tasks.render_prompt(ChatTok(), row) == [1, 2, ord("h"), ord("i")]
