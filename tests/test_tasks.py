"""The offline arithmetic task, answer extraction, the data loaders, rewards and prompts."""

from __future__ import annotations

import json
import pickle
import threading

import datasets
import pytest

from grpo_nb import tasks
from grpo_nb.tasks import ArithmeticTaskConfig, extract_answer, make_dataset, make_reward


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
    reward, bonus = make_reward("math"), make_reward("math+0.1*format")
    assert reward("0009", "0009") == 1.0
    assert reward("9", "0009") == 1.0  # numeric equality, not string equality
    assert reward("0008", "0009") == 0.0
    assert reward("0009 12", "0009") == 0.0  # kept talking: the last number is what counts
    assert reward("", "0009") == 0.0
    assert bonus("0008", "0009") == pytest.approx(0.1)
    assert bonus("0009", "0009") == pytest.approx(1.1)
    assert bonus("the sum is 9", "0009") == pytest.approx(1.0)


def test_reward_uses_math_verify_for_latex():
    reward = make_reward("math")
    assert reward("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert reward("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}") == 0.0


def test_load_gsm8k_shape_from_jsonl(tmp_path):
    rows = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
            {"question": "Big?", "answer": "lots\n#### 1,200"}]
    for split in ("train", "test"):
        write_jsonl(tmp_path / f"{split}.jsonl", rows)
    data = tasks.load_task(str(tmp_path)).test
    assert data["answer"] == ["7", "1200"]
    assert data[0]["prompt"].startswith("Tom has 3 apples")
    assert tasks.HUB_INSTRUCTION in data[0]["prompt"]
    assert data[0]["messages"] == [{"role": "user", "content": data[0]["prompt"]}]
    assert make_reward("math")("so \\boxed{1200}", data[1]["answer"]) == 1.0


def test_load_openr1_shape_from_parquet(tmp_path):
    path = tmp_path / "openr1.parquet"
    datasets.Dataset.from_list([
        {"problem": "Compute 1/2 + 0.", "solution": "...", "answer": "\\frac{1}{2}"},
        {"problem": "Compute 1 + 1.", "solution": "...", "answer": "2"},
    ]).to_parquet(str(path))
    task = tasks.load_task(str(path), test_size=1)
    answers = sorted(r["answer"] for r in [*task.train, *task.test])
    assert answers == ["2", "\\frac{1}{2}"]
    assert make_reward("math")("\\boxed{0.5}", answers[1]) == 1.0


class CharTok:
    """A template-less character tokenizer (like the tiny model's)."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        assert not add_special_tokens
        return [ord(c) for c in text]


class ChatTok(CharTok):
    """A tokenizer with a Qwen-like template (rendered by hand, as transformers would)."""

    chat_template = "qwen-like"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        assert tokenize is False
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        if kwargs.get("enable_thinking") is False:
            text += "<nothink>"
        return text + ("<assistant>" if add_generation_prompt else "")


def test_render_prompt_plain_and_chat():
    row = {"prompt": "1+2=", "answer": "3", "messages": [{"role": "user", "content": "1+2="}]}
    assert tasks.render_prompt(CharTok(), row) == [ord(c) for c in "1+2="]
    assert tasks.render_prompt(CharTok(), {"prompt": "1+2=", "answer": "3"}) == [
        ord(c) for c in "1+2="]
    chat = ChatTok()
    assert tasks.prompt_text(chat, row) == "<user>1+2=|<assistant>"
    assert tasks.render_prompt(chat, row) == [ord(c) for c in "<user>1+2=|<assistant>"]
    assert tasks.prompt_text(chat, row, add_generation_prompt=False) == "<user>1+2=|"
    assert tasks.prompt_text(chat, row, chat_template_kwargs={"enable_thinking": False}
                             ).endswith("<nothink><assistant>")


def test_render_prompt_keeps_the_system_prompt_without_a_template():
    task = tasks.load_task("arithmetic", arithmetic=SMALL, system_prompt="Add.")
    row = task.train[0]
    assert tasks.prompt_text(CharTok(), row) == f"Add.\n\n{row['prompt']}"
    assert tasks.prompt_text(ChatTok(), row) == f"<system>Add.|<user>{row['prompt']}|<assistant>"


# ------------------------------------------------------------------ load_task: by configuration

SMALL = ArithmeticTaskConfig(digits=2, n_train=200, n_test=20)
GSM8K_ROWS = [{"question": f"Q{i}: what is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
              for i in range(50)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_task_arithmetic_family_keeps_the_tiny_model_format():
    task = tasks.load_task("arithmetic", arithmetic=SMALL)
    reference = make_dataset(SMALL)
    assert task.kind == "arithmetic" and task.default_reward == "exact"
    assert task.train["prompt"] == reference["train"]["prompt"]
    assert task.test["answer"] == reference["test"]["answer"]
    assert task.train[0]["messages"] == [{"role": "user", "content": task.train[0]["prompt"]}]
    assert [m for m in task.test["messages"]] == [[{"role": "user", "content": p}]
                                                  for p in task.test["prompt"]]
    assert tasks.render_prompt(CharTok(), task.train[0]) == [ord(c) for c in task.train[0]["prompt"]]

    named = tasks.load_task("arithmetic:1digit:+-", arithmetic=ArithmeticTaskConfig(
        n_train=40, n_test=5), test_size=7, system_prompt="Add.")
    assert len(named.test) == 7 and len(named.train) == 40
    assert all(len(p) == 4 for p in named.train["prompt"])  # "3+6=": one digit per operand
    assert {p[1] for p in named.train["prompt"]} == {"+", "-"}
    assert [m for m in named.train["messages"]] == [
        [{"role": "system", "content": "Add."}, {"role": "user", "content": p}]
        for p in named.train["prompt"]]


@pytest.mark.parametrize("name, error, match", [
    ("arithmetic:3digits:*", ValueError, "arithmetic"), ("arithmetic:x", ValueError, "<N>digit"),
    ("", ValueError, "dataset"), ("no such thing!", ValueError, "hub name"),
    ("./missing.jsonl", FileNotFoundError, "missing.jsonl"),
])
def test_dataset_source_rejects_bad_names(name, error, match):
    with pytest.raises(error, match=match):
        tasks.dataset_source(name)


def test_dataset_source_kinds(tmp_path):
    assert tasks.dataset_source("arithmetic:2digit") == "arithmetic"
    assert tasks.dataset_source("openai/gsm8k") == "hub"
    assert tasks.dataset_source("openai/gsm8k:socratic") == "hub"
    assert tasks.dataset_source(str(write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS))) == "local"
    assert tasks.dataset_source(str(tmp_path)) == "local"


def test_load_task_gsm8k_file_holds_out_a_seeded_split(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    task = tasks.load_task(str(path), test_size=10, split_seed=1, system_prompt="Be brief.")
    assert task.kind == "math" and task.default_reward == "math"
    assert (len(task.train), len(task.test)) == (40, 10)
    assert not set(task.train["prompt"]) & set(task.test["prompt"])
    row = task.test[0]
    i = int(row["prompt"][1:].split(":")[0])
    assert row["answer"] == str(i + 1)
    assert row["prompt"] == f"Q{i}: what is {i} + 1?\n{tasks.HUB_INSTRUCTION}"
    assert row["messages"] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": row["prompt"]}]
    again = tasks.load_task(str(path), test_size=10, split_seed=1)
    assert again.test["prompt"] == task.test["prompt"]
    assert tasks.load_task(str(path), test_size=10, split_seed=2).test["prompt"] != task.test["prompt"]
    assert len(tasks.load_task(str(path), test_size=0.2).test) == 10
    assert len(tasks.load_task(str(path)).test) == 5  # default: 10 % held out
    bare = tasks.load_task(str(path), instruction=None)
    assert "boxed" not in bare.train[0]["prompt"]


def test_load_task_uses_the_folders_own_splits_and_parquet(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS[:30])
    write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[30:33])
    task = tasks.load_task(str(tmp_path), test_size=0.5)  # test_size unused: there is a test split
    assert (len(task.train), len(task.test)) == (30, 3)
    assert task.test["answer"] == ["31", "32", "33"]
    parquet = tmp_path / "p" / "data.parquet"
    parquet.parent.mkdir()
    datasets.Dataset.from_list(GSM8K_ROWS).to_parquet(str(parquet))
    assert len(tasks.load_task(str(parquet), test_size=5).test) == 5


def test_load_task_messages_format(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "old"}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "2+2=4\n#### 4"}]},
        {"messages": [{"role": "user", "content": "half?"},
                      {"role": "assistant", "content": "It is \\boxed{\\frac{1}{2}}."}]},
        {"messages": [{"role": "user", "content": "ten?"}, {"role": "assistant", "content": "10"}]},
    ]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(rows))
    task = tasks.load_task(str(path), test_size=1, system_prompt="new")
    by_prompt = {r["prompt"]: r for r in [*task.train, *task.test]}
    assert by_prompt["2+2?"]["answer"] == "4"
    assert by_prompt["half?"]["answer"] == "\\frac{1}{2}"
    assert by_prompt["ten?"]["answer"] == "10"
    assert by_prompt["2+2?"]["messages"] == [{"role": "system", "content": "new"},
                                             {"role": "user", "content": "2+2?"}]
    kept = tasks.load_task(str(path), test_size=1)
    kept_rows = {r["prompt"]: r for r in [*kept.train, *kept.test]}
    assert kept_rows["2+2?"]["messages"][0] == {"role": "system", "content": "old"}
    with_answer = write_jsonl(tmp_path / "chat2.jsonl", [{**rows[2], "answer": "#### 11"},
                                                         {**rows[1], "answer": "0.5"}])
    answered = tasks.load_task(str(with_answer), test_size=1)
    assert sorted(r["answer"] for r in [*answered.train, *answered.test]) == ["0.5", "11"]


@pytest.mark.parametrize("rows, match", [
    ([{"text": "x"}] * 3, r"columns \['text'\]"),
    ([{"question": "q", "answer": "7"}] * 3, r"row 0.*'####"),
    ([{"messages": [{"role": "user", "content": "q"}]}] * 3, "must end with the assistant"),
    ([{"messages": [{"role": "user", "content": "q"},
                    {"role": "assistant", "content": "no idea"}]}] * 3, "cannot find the final"),
])
def test_load_task_errors_name_the_problem(tmp_path, rows, match):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=match):
        tasks.load_task(str(path), test_size=1)


def test_load_task_empty_and_unsupported_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        tasks.load_task(str(empty))
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match="parquet"):
        tasks.load_task(str(csv))
    one = write_jsonl(tmp_path / "one.jsonl", GSM8K_ROWS[:1])
    with pytest.raises(ValueError, match="test_size"):
        tasks.load_task(str(one))  # one row: nothing left to train on
    with pytest.raises(ValueError, match="test_size"):
        tasks.load_task("arithmetic", arithmetic=SMALL, test_size=0.1)


def test_hub_dataset_offline_fails_with_advice(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"openai/gsm8k.*Offline\?.*jsonl") as info:
        tasks.load_task("openai/gsm8k")
    assert isinstance(info.value.__cause__, ConnectionError)


def test_hub_dataset_uses_its_config_and_splits(monkeypatch):
    calls = []

    def fake(repo, config=None, **kwargs):
        calls.append((repo, config))
        return datasets.DatasetDict(train=datasets.Dataset.from_list(GSM8K_ROWS[:20]),
                                    test=datasets.Dataset.from_list(GSM8K_ROWS[20:24]))

    monkeypatch.setattr(datasets, "load_dataset", fake)
    task = tasks.load_task("openai/gsm8k")
    assert (len(task.train), len(task.test)) == (20, 4)
    tasks.load_task("openai/gsm8k:socratic")
    assert calls == [("openai/gsm8k", "main"), ("openai/gsm8k", "socratic")]


# ------------------------------------------------------------------ rewards by configuration

def test_exact_reward_is_strict_and_numeric():
    exact = tasks.make_reward("exact")
    assert exact("0009", "0009") == 1.0
    assert exact(" 9 ", "0009") == 1.0
    assert exact("0008", "0009") == 0.0
    assert exact("the sum is 9", "0009") == 0.0  # not just the answer
    assert exact("x9", "0009") == 0.0
    assert exact("", "0009") == 0.0


def test_math_and_format_rewards_and_weighted_sums():
    math_reward = tasks.make_reward("math")
    assert math_reward("so the total is 12 + 7 = 19 apples.", "19") == 1.0
    assert math_reward("reasoning\n#### 1,200", "1200") == 1.0
    assert math_reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert math_reward("\\boxed{18}", "19") == 0.0
    combined = tasks.make_reward("math+0.1*format")
    assert combined("\\boxed{19}", "19") == pytest.approx(1.1)
    assert combined("it is 19", "19") == pytest.approx(1.0)
    assert combined("\\boxed{18}", "19") == pytest.approx(0.1)
    listed = tasks.make_reward([("math", 2.0), ("format", 0.5)])
    assert listed("\\boxed{19}", "19") == pytest.approx(2.5)
    assert tasks.make_reward(["math", ("format", 0.25)]).terms == (("math", 1.0), ("format", 0.25))


def test_auto_reward_follows_the_task():
    task = tasks.load_task("arithmetic", arithmetic=SMALL)
    arithmetic = tasks.make_reward("auto", default=task.default_reward)
    assert arithmetic("x9", "0009") == 0.0  # exact: strict
    assert tasks.make_reward("auto", default="math")("x9", "0009") == 1.0


def half_credit(completion_text, answer):
    return 0.5 if answer in completion_text else 0.0


def test_user_rewards_callable_and_by_import_path():
    direct = tasks.make_reward(half_credit)
    assert direct("... 19", "19") == 0.5 and direct.terms == ((half_credit, 1.0),)
    by_path = tasks.make_reward(f"{__name__}:half_credit+math")
    assert by_path("... 19", "19") == 1.5
    assert pickle.loads(pickle.dumps(by_path))("... 19", "19") == 1.5
    with pytest.raises(TypeError, match="not a number"):
        tasks.make_reward("os.path:join")("a", "b")


@pytest.mark.parametrize("spec, match", [
    ("nope", r"'nope': unknown; use one of \['exact', 'format', 'math'\]"),
    ("math+", "cannot read the term"),
    ("no_such_module_xyz:f", "cannot import"),
    (lambda text: 1.0, r"must accept \(completion_text, answer\)"),
    ([("math", float("nan"))], "not finite"),
    ([], "at least one"),
])
def test_bad_reward_specs_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        tasks.make_reward(spec)


def test_math_verify_works_off_the_main_thread():
    # math-verify's timeout uses SIGALRM, which only the main thread may set.
    results = []
    thread = threading.Thread(target=lambda: results.append(
        tasks.make_reward("math")("\\boxed{0.5}", "\\frac{1}{2}")))
    thread.start()
    thread.join()
    assert results == [1.0]


def test_reward_terms_check_a_spec_without_importing_it():
    import sys

    name = "grpo_nb_test_unimported_reward_module"
    assert tasks.reward_terms(f"{name}:score+0.5*format") == ((f"{name}:score", 1.0),
                                                             ("format", 0.5))
    assert name not in sys.modules  # a config names it; the scorer imports it
    for spec, match in [("nope", "unknown"), ("a.b:", "module:function"),
                        (lambda text: 1.0, "must accept")]:
        with pytest.raises(ValueError, match=match):
            tasks.reward_terms(spec)
    with pytest.raises(ValueError, match="cannot import"):
        tasks.make_reward(f"{name}:score")


def test_check_task_fields_names_the_config_field():
    from types import SimpleNamespace

    good = dict(dataset="arithmetic", test_size=None, system_prompt=None,
                chat_template_kwargs=None, reward="no_such_module_xyz:f")
    tasks.check_task_fields(SimpleNamespace(**good))  # import paths resolve in the scorer
    for field, value in [("dataset", "arithmetic:x"), ("test_size", 0), ("reward", "math+")]:
        with pytest.raises(ValueError, match=rf"LLMConfig\.{field}="):
            tasks.check_task_fields(SimpleNamespace(**{**good, field: value}))
    from grpo_nb.llm.config import LLMConfig

    # the fields' types: checked by the config's check_fields before check_task_fields runs
    for field, value in [("test_size", True), ("system_prompt", 3), ("chat_template_kwargs", "x")]:
        with pytest.raises(ValueError, match=rf"LLMConfig\.{field}="):
            LLMConfig(**{field: value})
    with pytest.raises(ValueError, match=r"LLMConfig\.max_prompt_len="):  # the config's own bound
        LLMConfig(max_prompt_len=0)
