"""The configs: construction checks every field against its annotation (one mechanism,
``config.check_fields``) and touches no device and no data; ``LLMConfig.resolve`` fills the rest
into a new config; ``--set FIELD=VALUE`` reads any field, for ``train`` and ``toy`` alike."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from grpo_nb.course.handouts import HandoutConfig
from grpo_nb.llm import placement
from grpo_nb.llm.config import LLMConfig
from grpo_nb.serving.client import ClientConfig
from grpo_nb.serving.server import ServerConfig
from grpo_nb.tasks import ArithmeticTaskConfig
from grpo_nb.tiny_model import TinyModelConfig
from grpo_nb.toy.task import ToyConfig
from grpo_nb.weight_sync import WeightSyncConfig

CONFIGS = (LLMConfig, ToyConfig, WeightSyncConfig, ServerConfig, ClientConfig,
           ArithmeticTaskConfig, TinyModelConfig, HandoutConfig)


def _no_device_no_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def touched() -> bool:
        raise AssertionError("the config asked torch for CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", touched)
    monkeypatch.setattr(torch.cuda, "device_count", touched)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError


@pytest.mark.parametrize("kwargs", [
    {}, {"dtype": "bfloat16", "overlong": "soft", "sync": {"transport": "reload"}},
    {"model": "Qwen/Qwen3-0.6B", "dataset": "openai/gsm8k", "device": "cuda"},
])
def test_construction_touches_no_device_and_no_data(monkeypatch, kwargs) -> None:
    _no_device_no_data(monkeypatch)
    cfg = LLMConfig(**kwargs)
    assert cfg.defaults is None  # nothing resolved yet
    assert (cfg.lr, cfg.max_tokens, cfg.loss_agg, cfg.ratio_against) == (None, None, None, "auto")
    assert cfg.replace(steps=3).steps == 3 and LLMConfig.smoke().steps < cfg.steps


def test_resolve_returns_a_new_config_and_its_defaults(monkeypatch) -> None:
    monkeypatch.setattr(placement, "cuda_available", lambda: False)
    cfg = LLMConfig(overlong="soft", sync={"transport": "reload"})
    before = cfg.to_dict()
    assert cfg.sync.pause_mode == "auto"  # a sync dict without one: the ring's, at resolve
    resolved = cfg.resolve()
    assert resolved is not cfg and cfg.to_dict() == before and cfg.defaults is None
    assert (resolved.lr, resolved.max_tokens, resolved.overlong_buffer, resolved.loss_agg,
            resolved.ratio_against, resolved.sync.pause_mode) == (
        3e-4, 8, 2, "token-mean", "sampler", "none")
    assert set(resolved.defaults) == {"lr", "max_tokens", "overlong_buffer", "loss_agg",
                                      "ratio_against", "sync.pause_mode"}
    assert resolved.defaults["max_tokens"].startswith("8 (for 'arithmetic'")
    again = resolved.resolve()  # resolving twice changes nothing
    assert again == resolved and again.defaults == resolved.defaults
    # a chosen value is kept and not listed; a resolved copy's replace resolves again
    assert "lr" not in cfg.replace(lr=1e-5).resolve().defaults
    bigger = resolved.replace(max_tokens=40)
    assert bigger.overlong_buffer == 10 and "max_tokens" not in bigger.defaults
    # the device is checked at resolve, not at construction
    with pytest.raises(ValueError, match=r"LLMConfig\.device='cuda': no CUDA device"):
        LLMConfig(device="cuda").resolve()


@pytest.mark.parametrize(("cls", "kwargs", "message"), [
    (LLMConfig, {"prompts_per_step": 0},
     "LLMConfig.prompts_per_step=0: must be greater than or equal to 1"),
    (LLMConfig, {"steps": "3"}, "LLMConfig.steps='3': must be a valid integer"),
    (LLMConfig, {"mode": "turbo"}, "LLMConfig.mode='turbo': must be 'async' or 'sync'"),
    (LLMConfig, {"gpu_memory_utilization": 1.5},
     "LLMConfig.gpu_memory_utilization=1.5: must be less than or equal to 1"),
    (LLMConfig, {"sync": {"timeout_s": 0}}, "WeightSyncConfig.timeout_s=0: must be greater"),
    (ToyConfig, {"clip": 1.5}, "ToyConfig.clip=1.5: must be less than 1"),
    (ToyConfig, {"dynamic_sampling": 1}, "ToyConfig.dynamic_sampling=1: must be a valid bool"),
    (WeightSyncConfig, {"send_dtype": "int8"}, "WeightSyncConfig.send_dtype='int8': must be"),
    (ServerConfig, {"port": 70000}, "ServerConfig.port=70000: must be less than or equal"),
    (ClientConfig, {"retries": -1}, "ClientConfig.retries=-1: must be greater than or equal"),
    (ArithmeticTaskConfig, {"digits": 10}, "ArithmeticTaskConfig.digits=10: must be less"),
    (TinyModelConfig, {"target_acc": 2.0}, "TinyModelConfig.target_acc=2.0: must be less"),
    (HandoutConfig, {"cell_timeout_s": 0}, "HandoutConfig.cell_timeout_s=0: must be greater"),
])
def test_a_bad_value_names_the_config_and_field(cls, kwargs, message) -> None:
    if cls is HandoutConfig:
        kwargs = {"notebooks": Path(__file__).parent, "out": Path("unused"), **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**kwargs)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_is_documented_where_it_is_declared(cls) -> None:
    """A comment on the field's line, or a comment block right above it."""
    lines = inspect.getsource(cls).splitlines()
    for f in dataclasses.fields(cls):
        at = next(i for i, line in enumerate(lines) if re.match(rf"    {f.name}\s*:", line))
        assert "  # " in lines[at] or lines[at - 1].strip().startswith("#"), (cls, f.name)


def test_toy_cli_sets_any_field_and_refuses_an_unknown_one(monkeypatch, tmp_path, capsys) -> None:
    from grpo_nb.__main__ import main

    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path))
    assert main(["toy", "--smoke", "--name", "t", "--set", "steps=3", "--set", "lr=0.05",
                 "--set", "mode=sync", "--set", "gen_delay_s=0"]) == 0
    written = json.loads((tmp_path / "t" / "config.json").read_text())
    assert (written["steps"], written["lr"], written["mode"]) == (3, 0.05, "sync")
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["steps"] == 3
    for bad, why in (("nope=1", "ToyConfig has no field 'nope'"), ("steps=0", "ToyConfig.steps"),
                     ("lr=fast", "ToyConfig.lr must be a valid number"), ("steps", "FIELD=VALUE")):
        with pytest.raises(SystemExit) as exit_:
            main(["toy", "--set", bad])
        assert exit_.value.code == 2 and why in capsys.readouterr().err, bad
