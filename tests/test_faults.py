"""Fault injection against a real vLLM server: each fault ends the run with a clear error that
names its cause within 30 s, or the run goes on with the fault counted; no process is left
behind and the last checkpoint loads.

Cost: no server start of its own where the session's shared server is alive: every fault runs
on it, and the two that kill a server (mid-sync, mid-generation) run last of the whole suite
(marked ``kills_server``, fixture ``server_to_kill``): the first kills the session's server, the
second gets one of its own (``make test`` runs them in separate pytest processes, each ending
its own session server). The CLI's SIGKILL and resume are in ``test_llm_scale.py``. The SFT'd
tiny model (cached) is used so completions end with EOS and the reward function is called.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from grpo_nb.llm.config import LLMConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAULT_S = 30.0  # the promise: a clear error within this many seconds of the fault
SMALL = {"mode": "sync", "steps": 3, "generators": 1, "prompts_per_step": 2, "group_size": 2,
         "max_inflight": 4, "eval_every": 100, "eval_size": 4, "checkpoint_every": 1,
         "time_budget_s": 180.0}
TIMES: dict[str, float] = {}  # fault → seconds until the promised outcome (printed at the end)


def _cfg(**changes: Any) -> LLMConfig:
    return LLMConfig(**{**SMALL, **changes})


def _gone(server: Any, within_s: float = 15.0) -> float:
    """Seconds until no process of ``server`` is left (fails after ``within_s``)."""
    from grpo_nb.serving.processes import marked_processes

    start = time.monotonic()
    while (left := marked_processes([server.server_id])) and \
            time.monotonic() - start < within_s:
        time.sleep(0.2)
    assert not left, f"server processes left: {[p.pid for p in left]}"
    return time.monotonic() - start


def _kill(server: Any) -> None:
    from grpo_nb.serving.processes import marked_processes

    for p in marked_processes([server.server_id]):
        p.kill()


def _train(cfg: LLMConfig, model_dir: Path, server: Any, name: str, **kw: Any) -> Any:
    from grpo_nb.llm.run import train

    return asyncio.run(train(cfg, model_dir=model_dir, name=name, server=server, smoke=True,
                             progress=False, **kw))


def _load_checkpoint(folder: Path, model_dir: Path) -> dict[str, Any]:
    from grpo_nb.llm.policy import PolicyTrainer, load_policy

    model, tok = load_policy(model_dir)
    return PolicyTrainer(model, tok, _cfg()).load(folder)


@pytest.fixture(scope="module", autouse=True)
def _report_timings() -> Iterator[None]:
    yield
    print("\nfault timings (s):", json.dumps({k: round(v, 1) for k, v in TIMES.items()}))


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GRPO_NB_RUNS", str(tmp_path))
    return tmp_path


def test_a_config_that_could_never_admit_a_group_fails_before_any_server(runs: Path) -> None:
    from grpo_nb.serving.processes import owned_by

    start = time.monotonic()
    # Popen, for the pid: a server it started would carry it as its owner (other servers
    # on the machine, a notebook's say, are not this test's business)
    proc = subprocess.Popen([sys.executable, "-m", "grpo_nb", "train", "--smoke", "--set",
                             "sync_every=4", "--set", "max_staleness=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "GRPO_NB_RUNS": str(runs)})
    _, stderr = proc.communicate(timeout=120)
    TIMES["never-admit config"] = time.monotonic() - start
    assert proc.returncode != 0
    assert "sync_every=4 > max_staleness + 1" in stderr, stderr[-2000:]
    assert TIMES["never-admit config"] < FAULT_S + 30  # + the CLI's own imports
    # no server was started: none is left, and none wrote a log (its watchdog may have ended
    # one whose owner exited, but not its log)
    assert not owned_by(proc.pid) and not list(runs.rglob("server-*.log"))


def test_nan_loss_is_skipped_counted_and_the_run_goes_on(ring_server, tiny_model_dir, runs,
                                                         monkeypatch) -> None:
    from grpo_nb.llm.policy import PolicyTrainer
    from grpo_nb.llm.run import RunAborted
    from grpo_nb.metrics import load_metrics

    real, calls = PolicyTrainer._micro_loss, {"n": 0, "nan_from": 2, "nan_to": 2}

    def poisoned(self, b, *rest):
        calls["n"] += 1
        loss, metrics = real(self, b, *rest)
        nan = calls["nan_from"] <= calls["n"] <= calls["nan_to"]
        return (loss * float("nan"), metrics) if nan else (loss, metrics)

    monkeypatch.setattr(PolicyTrainer, "_micro_loss", poisoned)
    r = _train(_cfg(), tiny_model_dir, ring_server, "nan")
    assert r.steps == 3 and r.skipped_steps == 1 and r.weights_verified, r
    rec = load_metrics(runs / "nan")
    assert [row["reason"] for row in rec.rows("skipped")] == ["loss=nan"]
    assert [row["skipped_steps"] for row in rec.rows("step")] == [0, 1, 1]
    assert _load_checkpoint(runs / "nan" / "checkpoint", tiny_model_dir)["step"] == 3

    # A loss that stays NaN: past error_budget skipped steps the run stops, naming why.
    calls.update(n=0, nan_from=1, nan_to=10**9)
    start = time.monotonic()
    with pytest.raises(RunAborted, match=r"non-finite loss or gradient .*error_budget=1"):
        _train(_cfg(error_budget=1), tiny_model_dir, ring_server, "nan-always")
    TIMES["NaN loss, persistent"] = time.monotonic() - start
    assert TIMES["NaN loss, persistent"] < FAULT_S + 30  # includes start-up sync and eval
    assert ring_server.healthy()


REWARD_CALLS = {"n": 0, "t": 0.0}


def exploding_reward(text: str, answer: str) -> float:
    """Module-level: actors receive a pickled config, and this travels by reference, so the
    counters are this module's (a closure's would be a copy)."""
    REWARD_CALLS["n"] += 1
    if REWARD_CALLS["n"] > 2 * SMALL["prompts_per_step"] * SMALL["group_size"]:  # past step 1's
        REWARD_CALLS["t"] = REWARD_CALLS["t"] or time.monotonic()              # checkpoint
        raise ValueError("reward exploded on purpose")
    return float(text.strip() == answer.strip())


def test_a_reward_function_that_raises_ends_the_run_naming_it(ring_server, tiny_model_dir, runs
                                                              ) -> None:
    from grpo_nb.llm.run import RunAborted

    calls, reward = REWARD_CALLS, exploding_reward
    with pytest.raises(RunAborted, match=r"ring actor scorer failed: ValueError\('reward "
                                         r"exploded on purpose'\)"):
        _train(_cfg(steps=20, reward=reward), tiny_model_dir, ring_server, "reward")
    TIMES["reward raises"] = time.monotonic() - calls["t"]
    assert calls["t"] and TIMES["reward raises"] < FAULT_S
    assert _load_checkpoint(runs / "reward" / "checkpoint", tiny_model_dir)["step"] >= 1
    assert ring_server.healthy()


def test_abort_mode_drops_and_resubmits_groups_cut_by_a_sync(ring_server, tiny_model_dir, runs,
                                                             monkeypatch) -> None:
    """Long requests (200 tokens, EOS ignored) are in flight whenever the trainer syncs in
    async mode; /pause?mode=abort cuts them: never scored, counted, sampled again."""
    from grpo_nb.llm import actors
    from grpo_nb.serving.client import CompletionsClient
    from grpo_nb.weight_sync import WeightSyncConfig

    generate, process = CompletionsClient.generate, actors.Scorer.process
    scored: list[str | None] = []

    async def long_requests(self, prompt_ids, **kw):  # the generators' groups
        if kw.get("temperature", 1.0) > 0:  # not the greedy evaluation's requests
            kw.update(max_tokens=200, ignore_eos=True)
        return await generate(self, prompt_ids, **kw)

    async def recording(self, group):
        scored.extend(r.finish_reason for r in group.rollouts)
        return await process(self, group)

    monkeypatch.setattr(CompletionsClient, "generate", long_requests)
    monkeypatch.setattr(actors.Scorer, "process", recording)
    cfg = _cfg(mode="async", max_ahead=1, sync=WeightSyncConfig(pause_mode="abort"))
    r = _train(cfg, tiny_model_dir, ring_server, "abort")
    assert r.steps == 3 and r.weights_verified, r
    assert r.aborted_groups >= 1, r  # requests were in flight at a sync, and were cut
    assert scored and "abort" not in scored and set(scored) == {"length"}


def test_a_prompt_over_the_context_length_is_dropped_counted_and_resubmitted(
        ring_server, tiny_model_dir, runs, monkeypatch) -> None:
    from grpo_nb.llm import actors
    from grpo_nb.llm.data import Prompt
    from grpo_nb.llm.run import RunAborted

    init, only_long = actors.Generator.__init__, {"on": False}

    def with_long_prompts(self, cfg, spec, out, metrics):
        long = Prompt("too long", spec.prompts[0].ids * 400, "0")  # > max_model_len tokens
        prompts = [long] * len(spec.prompts) + ([] if only_long["on"] else spec.prompts)
        init(self, cfg, dataclasses.replace(spec, prompts=prompts), out, metrics)

    monkeypatch.setattr(actors.Generator, "__init__", with_long_prompts)
    r = _train(_cfg(error_budget=100), tiny_model_dir, ring_server, "long")
    assert r.steps == 3 and r.failed_requests >= 1 and r.weights_verified, r

    only_long["on"] = True  # every prompt too long: the error budget runs out, the cause named
    start = time.monotonic()
    with pytest.raises(RunAborted, match=r"gen[01]: \d+ failed requests \(> LLMConfig.error_budget"
                                         r"=2\); last: HTTP 400"):
        _train(_cfg(error_budget=2), tiny_model_dir, ring_server, "long-always")
    TIMES["prompt over context, every request"] = time.monotonic() - start
    assert TIMES["prompt over context, every request"] < FAULT_S + 30  # + start-up sync, eval
    assert ring_server.healthy()


@pytest.mark.kills_server
def test_killing_the_server_mid_sync_ends_the_run_clearly(server_to_kill, tiny_model_dir, runs,
                                                          monkeypatch) -> None:
    """Runs after every other test of the suite (``kills_server``): it kills its server."""
    from grpo_nb.llm.run import RunAborted
    from grpo_nb.weight_sync import WeightSyncer

    transfer, state = WeightSyncer._transfer, {"n": 0, "t": 0.0}

    def killing(self, *args, **kwargs):
        state["n"] += 1
        if state["n"] == 3:  # the sync after step 2 (1: start-up, 2: after step 1)
            _kill(server_to_kill)
            state["t"] = time.monotonic()
        return transfer(self, *args, **kwargs)

    monkeypatch.setattr(WeightSyncer, "_transfer", killing)
    with pytest.raises(RunAborted, match=r"the vLLM server at .* exited"):
        _train(_cfg(steps=20), tiny_model_dir, server_to_kill, "kill-sync")
    TIMES["server killed mid-sync"] = time.monotonic() - state["t"]
    assert state["t"] and TIMES["server killed mid-sync"] < FAULT_S
    assert _load_checkpoint(runs / "kill-sync" / "checkpoint", tiny_model_dir)["step"] >= 1
    server_to_kill.stop()
    _gone(server_to_kill, within_s=5.0)


@pytest.mark.kills_server
def test_killing_the_server_mid_generation_ends_the_run_clearly(server_to_kill, tiny_model_dir,
                                                                runs, monkeypatch) -> None:
    """Runs after every other test of the suite (``kills_server``): it kills its server."""
    from grpo_nb.llm.run import RunAborted
    from grpo_nb.serving.client import CompletionsClient

    generate, state = CompletionsClient.generate, {"groups": 0, "t": 0.0}

    async def killing(self, prompt_ids, **kw):  # the generators' groups
        state["groups"] += kw.get("temperature", 1.0) > 0  # not the greedy evaluation's
        if state["groups"] == 5:  # step 2's first group: its request is in flight
            asyncio.get_running_loop().call_later(0.05, _kill, server_to_kill)
            state["t"] = time.monotonic()
        return await generate(self, prompt_ids, **kw)

    monkeypatch.setattr(CompletionsClient, "generate", killing)
    try:
        with pytest.raises(RunAborted, match=r"the vLLM server at .* exited"):
            _train(_cfg(steps=20), tiny_model_dir, server_to_kill, "kill-gen")
        TIMES["server killed mid-generation"] = time.monotonic() - state["t"]
        assert state["t"] and TIMES["server killed mid-generation"] < FAULT_S
    finally:
        server_to_kill.stop()
    _gone(server_to_kill, within_s=5.0)
    assert _load_checkpoint(runs / "kill-gen" / "checkpoint", tiny_model_dir)["step"] >= 1


