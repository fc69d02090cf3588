"""Each exercise's checker, run without a server: the unsolved stub fails it, a plausible wrong
answer fails it, a right answer passes.

The checker is the notebook's own cell (found by its id) executed against a namespace that
holds what the notebook would have computed by then, built by hand: metric rows, completions,
groups, and a stand-in for the one server fact a checker asks (the served weight version).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nbformat

from grpo_nb import tasks
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.serving import rollouts
from grpo_nb.serving.rollouts import Group, Rollout
from grpo_nb.toy.run import summarize
from grpo_nb.toy.task import ToyConfig

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def cell_source(notebook: str, cell_id: str) -> str:
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    (cell,) = [c for c in nb.cells if c.get("id") == cell_id]
    return cell.source


def passes(notebook: str, checker_id: str, namespace: dict[str, Any]) -> bool:
    """Whether the checker cell runs to the end in ``namespace`` (an AssertionError: no)."""
    try:
        exec(compile(cell_source(notebook, checker_id), f"{notebook}:{checker_id}", "exec"),
             namespace)
    except AssertionError:
        return False
    return True


# ── 02 · Exercise 1: mean staleness per generator ──

NB02 = "02_toy_grpo_ring.ipynb"
# Unequal numbers of groups per generator: an unweighted mean of means is not the run's mean.
STEPS_02 = [(["gen0", "gen1"], [0, 1]), (["gen0", "gen0"], [1, 2]), (["gen2", "gen0"], [3, 0]),
            (["gen1", "gen0"], [2, 1])]


def namespace_02() -> dict[str, Any]:
    rec = MetricsRecorder(None)
    for k, (sources, staleness) in enumerate(STEPS_02):
        rec.log("step", sources=sources, staleness=staleness, reward=0.5, expected_reward=0.5,
                version=k + 1)
    return {"MetricsRecorder": MetricsRecorder, "rec": rec,
            "result": summarize(rec, ToyConfig(), wall_s=1.0)}


def with_answer_02(fn: Callable[[MetricsRecorder], Any]) -> dict[str, Any]:
    ns = namespace_02()
    ns["staleness_by_generator"] = fn
    return ns


def exec_cell_02(cell_id: str) -> dict[str, Any]:
    ns = namespace_02()
    exec(cell_source(NB02, cell_id), ns)
    return ns


def per_step_means(r: MetricsRecorder) -> dict:
    """Wrong: each step's mean staleness, credited to every generator in that step."""
    out: dict = {}
    for row in r.rows("step"):
        for src in set(row["sources"]):
            out.setdefault(src, []).append(statistics.fmean(row["staleness"]))
    return {s: statistics.fmean(v) for s, v in out.items()}


def test_02_ex1_staleness_by_generator() -> None:
    checker = "e1c7a2b4"
    assert not passes(NB02, checker, exec_cell_02("9c8ecb19")), "the stub"
    right = exec_cell_02("19b826fe")["staleness_by_generator"]
    assert right(namespace_02()["rec"]) == {"gen0": 0.8, "gen1": 1.5, "gen2": 3.0}
    off_by = {d: (lambda r, d=d: {s: v + d for s, v in right(r).items()}) for d in (5, 0.01)}
    for name, wrong in [("off by 5", off_by[5]), ("off by 0.01", off_by[0.01]),
                        ("per-step means", per_step_means),
                        ("generator indices", lambda r: dict(enumerate(right(r).values())))]:
        assert not passes(NB02, checker, with_answer_02(wrong)), name
    assert passes(NB02, checker, with_answer_02(right)), "the solution"


# ── 04 · Exercises 1 and 2: temperature and mixed groups; a format bonus ──

NB04 = "04_vllm_rollouts.ipynb"
GROUP_SIZE = 4
PROMPTS = [{"prompt": f"00{k}+001=", "answer": f"000{k + 1}"} for k in range(3)]


def group(row: dict[str, str], texts: list[str], logprob: float, reward: str = "math") -> Group:
    score = tasks.make_reward(reward)
    return Group(group_id=0, prompt=row["prompt"], answer=row["answer"], prompt_ids=[1],
                 rollouts=[Rollout(prompt_ids=[1], completion_ids=[5, 6],
                                   sampler_logprobs=[logprob, logprob], completion_text=t,
                                   finish_reason="stop", reward=score(t, row["answer"]))
                           for t in texts],
                 policy_version=0, t_submit=0.0, t_done=1.0)


def groups_at_temperature(t: float) -> list[Group]:
    """At T=0.3 every sample of a group agrees and is near-certain; at T=1.5 they differ."""
    if t < 1:
        return [group(row, [row["answer"]] * GROUP_SIZE if k == 0 else ["7"] * GROUP_SIZE, -0.01)
                for k, row in enumerate(PROMPTS)]
    return [group(row, [row["answer"], "7", "77", row["answer"]], -1.2) for row in PROMPTS]


def namespace_04(**answer: Any) -> dict[str, Any]:
    return {"rollouts": rollouts, "tasks": tasks, "prompts": PROMPTS, "group_size": GROUP_SIZE,
            **answer}


def test_04_ex1_mixed_groups_against_temperature() -> None:
    checker = "a4c91e07"
    stub: dict[str, Any] = {}
    exec(cell_source(NB04, "98bb0862"), stub)
    assert not passes(NB04, checker, namespace_04(groups_at=stub["groups_at"],
                                                  mixed_at=stub["mixed_at"])), "the stub"
    groups_at = {t: groups_at_temperature(t) for t in (0.3, 1.5)}
    right = {0.3: 0.0, 1.5: 1.0}
    counts = {0.3: 0, 1.5: len(PROMPTS)}
    one_sampling = {t: groups_at[1.5] for t in (0.3, 1.5)}  # the temperature never reached it
    for name, ns in [("counts, not fractions", namespace_04(groups_at=groups_at, mixed_at=counts)),
                     ("sampled at one temperature",
                      namespace_04(groups_at=one_sampling, mixed_at={0.3: 1.0, 1.5: 1.0})),
                     ("temperatures swapped",
                      namespace_04(groups_at={0.3: groups_at[1.5], 1.5: groups_at[0.3]},
                                   mixed_at={0.3: 1.0, 1.5: 0.0}))]:
        assert not passes(NB04, checker, ns), name
    assert passes(NB04, checker, namespace_04(groups_at=groups_at, mixed_at=right)), "right"


def test_04_ex2_format_bonus() -> None:
    checker = "b83d5f16"
    stub: dict[str, Any] = {}
    exec(cell_source(NB04, "abd6c76d"), stub)
    assert not passes(NB04, checker, namespace_04(bonus_groups=stub["bonus_groups"])), "the stub"
    rows = [*PROMPTS, {"prompt": "005+005=", "answer": "0010"}]
    texts = ["7", "0010", "no", "12 13"]  # a bare wrong number, a right one, two badly shaped

    def scored(reward: str) -> list[Group]:
        return [group(row, [row["answer"] if t == "0010" else t for t in texts], -1.0, reward)
                for row in rows]

    for name, wrong in [("no bonus", scored("math")), ("the 0.1 bonus", scored("math+0.1*format")),
                        ("too few prompts", scored("math+0.2*format")[:2])]:
        assert not passes(NB04, checker, namespace_04(bonus_groups=wrong)), name
    assert passes(NB04, checker, namespace_04(bonus_groups=scored("math+0.2*format"))), "right"


# ── 05 · Exercise 3: a sync that aborts requests in flight ──

NB05 = "05_async_grpo.ipynb"


def completion(finish_reason: str, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(finish_reason=finish_reason, token_ids=list(range(tokens)), text="",
                           logprobs=[-1.0] * tokens)


def namespace_05(aborted: Any, served_version: str | None) -> dict[str, Any]:
    """The checker's namespace, with the served weight version as the only server fact."""

    class FakeControl:
        def __init__(self, url: str, api_key: str | None = None) -> None:
            assert url == "http://127.0.0.1:8000"

        def weight_version(self) -> str | None:
            return served_version

    return {"aborted": aborted, "VLLMControlClient": FakeControl,
            "server": SimpleNamespace(url="http://127.0.0.1:8000", api_key=None)}


def test_05_ex3_sync_aborts_requests_in_flight() -> None:
    checker = "7d43909b"
    stub: dict[str, Any] = {}
    exec(cell_source(NB05, "fd8d7eba"), stub)
    assert not passes(NB05, checker, namespace_05(stub["aborted"], "1")), "the stub"
    cut = [completion("abort", n) for n in (12, 12, 13, 13, 13, 14)]
    outs = [*cut, completion("length", 200), completion("length", 200)]
    for name, ns in [
        ("every completion, not only the aborted", namespace_05(outs, "1")),
        ("every completion, without ignore_eos",
         namespace_05([*cut, completion("stop", 6)], "1")),
        ("a run that never synced: nothing aborted", namespace_05([], "0")),
        ("a run that never synced: all finished", namespace_05(outs[-2:], "0")),
        ("paused by hand, never synced", namespace_05(cut, "0")),
        ("a completion kept twice", namespace_05(cut + cut, "1")),
    ]:
        assert not passes(NB05, checker, ns), name
    assert passes(NB05, checker, namespace_05(cut, "1")), "right"

