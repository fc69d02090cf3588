"""The LLM ring: config validation, the trainer's step and checkpoints, and real runs.

Runs use a randomly initialised tiny Qwen3 (weights, schedule, sync and shutdown are what is
tested here; learning is measured by ``python -m grpo_nb train``, see the report). Server
starts: one shared by the ring tests (the kill test, last to use it, kills it) and one owned
by the CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.trainer import PolicyTrainer, make_batch
from grpo_nb.serving.rollouts import Group, Rollout

# ── config ──


@pytest.mark.parametrize(("changes", "field"), [
    ({"group_size": 1}, "group_size"),
    ({"max_inflight": 4, "group_size": 8}, "max_inflight"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"prompts_per_step": 6, "grad_accum": 4}, "prompts_per_step"),
    ({"mode": "turbo"}, "mode"),
    ({"loss_agg": "sum"}, "loss_agg"),
    ({"steps": 0}, "steps"),
    ({"lr": 0.0}, "lr"),
])
def test_bad_config_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LLMConfig(**changes)


def test_smoke_preset_is_smaller_and_valid() -> None:
    full, smoke = LLMConfig(), LLMConfig.smoke()
    assert smoke.steps < full.steps and smoke.eval_size <= full.eval_size
    assert LLMConfig(**{**full.to_dict(), "mode": "sync"}).sync.transport == "gloo"


# ── trainer, no server ──


def _group(prompt: list[int], completions: list[list[int]], rewards: list[float],
           version: int = 0) -> Group:
    from grpo_nb.grpo import group_advantages

    adv = group_advantages(torch.tensor(rewards), len(rewards)).tolist()
    rollouts = [Rollout(prompt, c, [-1.0] * len(c), "", "stop", r, a, policy_version=version)
                for c, r, a in zip(completions, rewards, adv, strict=True)]
    return Group(0, "", "", prompt, rollouts, version, 0.0, 0.0)


def test_make_batch_pads_and_masks_only_completion_tokens() -> None:
    g = _group([3, 4, 5], [[6, 1], [7, 8, 1]], [1.0, 0.0])
    b = make_batch([g], pad_id=0)
    assert b.input_ids.tolist() == [[3, 4, 5, 6, 1, 0], [3, 4, 5, 7, 8, 1]]
    # position t predicts token t+1: completion tokens sit at 3.. → mask from index 2
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert b.sampler_logprobs[0].tolist() == [0, 0, -1, -1, 0]
    assert b.advantages.tolist()[0] > 0 > b.advantages.tolist()[1]


def test_trainer_step_moves_probability_towards_rewarded_completion(random_model_dir) -> None:
    from grpo_nb.llm.trainer import sequence_logprobs
    from grpo_nb.tiny_model import load_hf

    model, tok = load_hf(random_model_dir)
    cfg = LLMConfig(prompts_per_step=2, group_size=2, grad_accum=2, lr=1e-2,
                    ratio_against="trainer")
    pt = PolicyTrainer(model, tok, cfg)
    good, bad = [6, 7, 1], [8, 9, 1]
    groups = [_group([3, 4, 5], [good, bad], [1.0, 0.0]), _group([3, 4, 5], [bad, good],
                                                                  [0.0, 1.0])]
    b = make_batch(groups[:1], tok.pad_token_id)

    def margin() -> float:
        with torch.no_grad():
            lp = (sequence_logprobs(model, b.input_ids, b.attention_mask, 1.0) * b.loss_mask)
        return float(lp[0].sum() - lp[1].sum())

    before = margin()
    for _ in range(3):
        row = pt.step(groups)
    assert margin() > before + 0.1
    assert row["step"] == 3 and row["reward"] == 0.5 and row["grad_norm"] > 0


def test_checkpoint_round_trip(random_model_dir, tmp_path: Path) -> None:
    from grpo_nb.tiny_model import load_hf

    model, tok = load_hf(random_model_dir)
    cfg = LLMConfig(prompts_per_step=1, group_size=2, ratio_against="trainer")
    pt = PolicyTrainer(model, tok, cfg)
    pt.step([_group([3, 4], [[5, 1], [6, 1]], [1.0, 0.0])])
    pt.save(tmp_path / "ckpt", {"dropped": 3})
    other = PolicyTrainer(load_hf(random_model_dir)[0], tok, cfg)
    saved = other.load(tmp_path / "ckpt")
    assert saved["dropped"] == 3 and other.step_count == 1
    for a, b in zip(model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert other.opt.state_dict()["state"].keys() == pt.opt.state_dict()["state"].keys()


# ── the controller's watchers, no server ──


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_server_watch_ends_the_relay_when_the_server_process_exits() -> None:
    """No polling: the watcher wakes when the process exits, and names the server."""
    from types import SimpleNamespace

    from grpo_nb.llm.run import RunAborted, ServerWatch
    from grpo_nb.ring import Controller

    proc = _sleeper()
    server = SimpleNamespace(proc=proc, url="http://127.0.0.1:1")

    async def main() -> float:
        watch = ServerWatch(server)
        assert await watch.gone_within(0.2) is None  # alive: no blame after the grace
        asyncio.get_running_loop().call_later(0.3, proc.kill)
        start = time.monotonic()
        try:
            with pytest.raises(RunAborted, match=r"vLLM server at http://127.0.0.1:1 exited "
                                                 r"\(code -9\): run aborted at step 7"):
                relay = Controller().relay({"trainer"}, watchers=[watch.died(lambda: 7)])
                await asyncio.wait_for(relay, 5.0)  # a watcher that never fires: fail, not hang
        finally:
            watch.close()
        assert await watch.gone_within(0.0) is not None  # dead: named at once
        return time.monotonic() - start

    try:
        assert asyncio.run(main()) < 2.0
    finally:
        proc.kill()
        proc.wait()


def test_error_explained_by_a_server_that_dies_within_the_grace() -> None:
    """An actor error that arrives before the server process is gone still blames it."""
    from types import SimpleNamespace

    from grpo_nb.llm.run import ServerWatch

    proc = _sleeper()

    async def main() -> str | None:
        watch = ServerWatch(SimpleNamespace(proc=proc, url="http://s"))
        asyncio.get_running_loop().call_later(0.5, proc.kill)
        try:
            return await watch.gone_within(5.0)
        finally:
            watch.close()

    try:
        assert asyncio.run(main()) == "the vLLM server at http://s exited (code -9)"
    finally:
        proc.kill()
        proc.wait()


def test_stop_must_be_an_asyncio_event() -> None:
    import threading

    from grpo_nb.llm.data import RingSpec
    from grpo_nb.llm.run import run_ring
    from grpo_nb.metrics import MetricsRecorder

    spec = RingSpec("http://s", "m", "/nowhere", [])
    with pytest.raises(TypeError, match="asyncio.Event"):
        asyncio.run(run_ring(LLMConfig(), spec, MetricsRecorder(None), stop=threading.Event()))


def test_the_four_actors_build_as_monarch_actors() -> None:
    pytest.importorskip("monarch.actor")
    from grpo_nb.actors import backend, class_for
    from grpo_nb.llm.actors import Generator, Reference, Scorer, Trainer

    api = backend("monarch")
    for cls, endpoints in [(Generator, {"start", "progress", "drain"}),
                           (Scorer, {"inlet", "start"}), (Reference, {"inlet", "start"}),
                           (Trainer, {"inlet", "start", "request_stop"})]:
        twin = class_for(cls, api)
        assert issubclass(twin, api.Actor) and issubclass(twin, cls)
        assert endpoints <= set(vars(twin))


# ── real runs ──

SMALL = {"steps": 4, "generators": 2, "prompts_per_step": 4, "group_size": 4,
         "max_inflight": 4, "eval_every": 2, "eval_size": 100, "checkpoint_every": 2,
         "time_budget_s": 120.0}


@pytest.fixture(scope="module")
def ring_server(random_model_dir: Path) -> Iterator[object]:
    pytest.importorskip("vllm")
    from grpo_nb.llm.run import start_server

    server = start_server(str(random_model_dir), LLMConfig(), progress=False)
    try:
        yield server
    finally:
        server.stop()


def _overlaps(rec, a: str, b: str) -> float:
    """Total seconds during which an ``a`` interval and a ``b`` interval overlap."""
    busy = rec.rows("busy")
    xs = [(r["start"], r["end"]) for r in busy if r["label"] == a]
    ys = [(r["start"], r["end"]) for r in busy if r["label"] == b]
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in xs for s2, e2 in ys)


@pytest.mark.vllm
@pytest.mark.slow
def test_async_and_sync_modes_run_verify_and_schedule_differently(
        ring_server, random_model_dir, tmp_path: Path, monkeypatch) -> None:
    from grpo_nb.llm.run import train
    from grpo_nb.metrics import load_metrics

    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path))
    results = {}
    for mode in ("async", "sync"):
        cfg = LLMConfig(mode=mode, **SMALL)
        results[mode] = asyncio.run(train(cfg, model_dir=random_model_dir, name=mode,
                                          server=ring_server, smoke=True, progress=False))
    for mode, r in results.items():
        assert r.steps == 4 and r.weights_verified, (mode, r)
        assert 0.0 <= r.accuracy_after <= 1.0 and r.sync_ms_mean > 0
        rec = load_metrics(tmp_path / mode)
        assert [row["step"] for row in rec.rows("step")] == [1, 2, 3, 4]
        assert max(s for row in rec.rows("step") for s in row["staleness"]) <= 2
        assert (tmp_path / mode / "checkpoint" / "model.safetensors").is_file()
    assert _overlaps(load_metrics(tmp_path / "sync"), "generate", "train") == 0.0
    assert _overlaps(load_metrics(tmp_path / "async"), "generate", "train") > 0.0
    assert results["sync"].staleness_mean == 0.0

    # resume: continue the async run to 6 steps from its checkpoint
    from grpo_nb.llm.run import train as train_again

    cfg = LLMConfig(mode="async", **{**SMALL, "steps": 6})
    r = asyncio.run(train_again(cfg, model_dir=random_model_dir, resume=tmp_path / "async",
                                server=ring_server, smoke=True, progress=False))
    steps = [row["step"] for row in load_metrics(tmp_path / "async").rows("step")]
    assert steps == [1, 2, 3, 4, 5, 6] and r.weights_verified
    state = json.loads((tmp_path / "async" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 6


@pytest.mark.vllm
@pytest.mark.slow
def test_stop_event_ends_the_run_early_on_verified_weights(ring_server, random_model_dir,
                                                          tmp_path, monkeypatch) -> None:
    """The notebook's Stop button: the trainer finishes its step, drains, syncs, checkpoints."""
    from grpo_nb.llm.run import train

    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path))

    async def main():
        stop = asyncio.Event()

        def on_event(kind: str, rec) -> None:
            if kind == "step":
                stop.set()

        return await train(LLMConfig(**{**SMALL, "steps": 50}), model_dir=random_model_dir,
                           name="stop", server=ring_server, on_event=on_event, stop=stop,
                           smoke=True, progress=False)

    r = asyncio.run(main())
    assert 1 <= r.steps <= 2 and r.weights_verified, r
    state = json.loads((tmp_path / "stop" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == r.steps


@pytest.mark.vllm
@pytest.mark.slow
def test_killing_the_server_ends_the_run_with_a_clear_error(ring_server, random_model_dir,
                                                             tmp_path, monkeypatch) -> None:
    """Runs after the ring test in this module: it kills the module's server."""
    from grpo_nb.llm.run import RunAborted, train
    from grpo_nb.serving import server as serving

    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path))
    killed_at: list[float] = []

    def on_event(kind: str, rec) -> None:
        if kind == "step" and not killed_at:
            for p in serving.find_server_processes([ring_server.server_id]):
                p.kill()
            killed_at.append(time.monotonic())

    cfg = LLMConfig(**{**SMALL, "steps": 50})
    with pytest.raises(RunAborted, match="vLLM server"):
        asyncio.run(train(cfg, model_dir=random_model_dir, name="kill", server=ring_server,
                          on_event=on_event, smoke=True, progress=False))
    assert killed_at and time.monotonic() - killed_at[0] < 30


@pytest.mark.vllm
@pytest.mark.slow
def test_cli_prints_a_json_summary_last_and_leaves_no_server(random_model_dir, tmp_path) -> None:
    env = {**os.environ, "GRPO_NB_RUNS": str(tmp_path), "GRPO_NB_SMOKE": "1"}
    proc = subprocess.run([sys.executable, "-m", "grpo_nb", "train", "--smoke", "--steps", "3",
                           "--model", str(random_model_dir), "--name", "cli", "--mode", "sync"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("steps", "accuracy_before", "accuracy_after", "wall_s", "sync_ms_mean",
                "stale_dropped", "weights_verified"):
        assert key in summary
    assert summary["steps"] == 3 and summary["weights_verified"] is True
    assert (tmp_path / "cli" / "dashboard.png").is_file()
    leftover = subprocess.run(["pgrep", "-f", f"vllm.*{random_model_dir}"], capture_output=True,
                              text=True).stdout.split()
    assert leftover == []
