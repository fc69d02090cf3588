"""Each exercise's checker, run without a server: the unsolved stub fails it, a plausible wrong
answer fails it, a right answer passes.

The checker is the notebook's own cell (found by its id) executed against a namespace that
holds what the notebook would have computed by then, built by hand: metric rows, completions,
groups, and a stand-in for the one server fact a checker asks (the served weight version).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import io
import re
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nbformat
import pytest
import torch

from grpo_nb import tasks
from grpo_nb.actors import Actor, Channel, concurrent_endpoint, endpoint
from grpo_nb.course import exercises
from grpo_nb.llm import rollouts
from grpo_nb.llm.data import Group, Rollout
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.toy.run import run_ring, summarize
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



# ── 01, 02 and 03: the notebook's checker cells, the solutions in notebooks/solutions/ ──
# The cells run as the kernel runs them (top-level await allowed, magics dropped); each answer
# is judged by grpo_nb.course.exercises.check exactly as the notebook calls it.

SOLUTIONS = NOTEBOOKS / "solutions"
NB01, NB03 = "01_actors_and_ports.ipynb", "03_grpo_objective.ipynb"


@pytest.fixture
def learning_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_NB_SOLUTIONS", raising=False)


async def run_cells(notebook: str, cell_ids: list[str], ns: dict[str, Any]) -> dict[str, Any]:
    for cell_id in cell_ids:
        lines = cell_source(notebook, cell_id).splitlines()
        source = "\n".join(ln for ln in lines if not ln.startswith("%"))
        code = compile(source, f"{notebook}:{cell_id}", "exec",
                       flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        if inspect.isawaitable(pending := eval(code, ns)):
            await pending
    return ns


async def verdict(exercise: str, checker: Callable[[Any], Any], answer: Any) -> bool:
    """Whether ``answer`` passes, judged as the notebook judges it (learning mode: ✓ or ✗)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if (pending := exercises.check(exercise, checker, {"answer": answer}, "answer")) is not None:
            await pending
    assert out.getvalue()[:1] in "✓✗", out.getvalue()
    return out.getvalue().startswith("✓")


def solution(exercise: str, ns: dict[str, Any], name: str) -> Any:
    """What ``solutions/<exercise>.py`` defines as ``name``, run in a copy of the notebook's state."""
    scope = dict(ns)
    exercises.load_solution(exercise, scope, folder=SOLUTIONS)
    return scope[name]


async def judge(exercise: str, checker: Callable[[Any], Any], ns: dict[str, Any], name: str,
                wrong: dict[str, Any]) -> None:
    assert not await verdict(exercise, checker, ns[name]), f"{exercise}: the stub passes"
    for label, answer in wrong.items():
        assert not await verdict(exercise, checker, answer), f"{exercise}: {label} passes"
    assert await verdict(exercise, checker, solution(exercise, ns, name)), f"{exercise}: solution"


SETUP_01 = ["f7ddebcd", "2a94ecb3", "d8b28b39"]  # imports; the generators; Producer, Doubler


class SquarerWithoutSentinel(Actor):
    def __init__(self) -> None:
        self.port, self.inbox = Channel.open()

    @endpoint
    async def inlet(self) -> Any:
        return self.port

    @endpoint
    async def run(self, out: Any) -> None:
        while (x := await self.inbox.recv()) is not None:
            out.send(x * x)  # never passes None on: the next stage waits for ever


class DoublingSquarer(SquarerWithoutSentinel):
    @endpoint
    async def run(self, out: Any) -> None:
        while (x := await self.inbox.recv()) is not None:
            out.send(2 * x)
        out.send(None)


def test_01_ex1_squarer(learning_mode: None) -> None:
    async def scenario() -> None:
        ns = await run_cells(NB01, [*SETUP_01, "6407177b", "de78161c"], {})
        await judge("01_ex1", ns["pipeline_problems"], ns, "Squarer",
                    {"no sentinel": SquarerWithoutSentinel, "doubles": DoublingSquarer})

    asyncio.run(scenario())


def test_01_ex2_unblock_the_manager(learning_mode: None) -> None:
    async def scenario() -> None:
        ns = await run_cells(NB01, [*SETUP_01, "5e390e32", "879bb81c"], {})
        assert ns["as_written"] == "DEADLOCK"

        class ConcurrentConfirm(ns["Manager"]):  # the other endpoint: still deadlocks
            @concurrent_endpoint
            async def confirm(self) -> str:
                return "confirmed"

        await judge("01_ex2", ns["unblock_problems"], ns, "FixedManager",
                    {"concurrent confirm": ConcurrentConfirm})

    asyncio.run(scenario())


class UnboundedQueue(Actor):
    """Forgets to wait while full: every put returns at once."""

    def __init__(self, capacity: int) -> None:
        self.items: list = []
        self.most = 0
        self.changed = asyncio.Condition()

    @concurrent_endpoint
    async def put(self, item: Any) -> None:
        async with self.changed:
            self.items.append(item)
            self.most = max(self.most, len(self.items))
            self.changed.notify_all()

    @concurrent_endpoint
    async def get(self) -> Any:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.items) > 0)
            return self.items.pop(0)

    @endpoint
    async def high_water(self) -> int:
        return self.most


class NewestFirstQueue(UnboundedQueue):
    """Bounded, but hands out the newest item."""

    @concurrent_endpoint
    async def put(self, item: Any) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.items) < 3)
            self.items.append(item)
            self.most = max(self.most, len(self.items))
            self.changed.notify_all()

    @concurrent_endpoint
    async def get(self) -> Any:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.items) > 0)
            item = self.items.pop()
            self.changed.notify_all()
            return item


def test_01_ex3_bounded_queue(learning_mode: None) -> None:
    async def scenario() -> None:
        ns = await run_cells(NB01, [*SETUP_01, "a72d4005", "04727925"], {})
        await judge("01_ex3", ns["queue_problems"], ns, "BoundedQueue",
                    {"unbounded": UnboundedQueue, "newest first": NewestFirstQueue})

    asyncio.run(scenario())


# 02: mean staleness per generator; an on-policy ring
NB02 = "02_toy_grpo_ring.ipynb"
# Unequal numbers of groups per generator: an unweighted mean of means is not the run's mean.
STEPS_02 = [(["gen0", "gen1"], [0, 1]), (["gen0", "gen0"], [1, 2]), (["gen2", "gen0"], [3, 0]),
            (["gen1", "gen0"], [2, 1])]


def namespace_02() -> dict[str, Any]:
    """Notebook 02 at its exercises: a main run `rec` (by hand) and the ring's names."""
    rec = MetricsRecorder(None)
    for k, (sources, staleness) in enumerate(STEPS_02):
        rec.log("step", sources=sources, staleness=staleness, reward=0.5, expected_reward=0.5,
                version=k + 1)
    return {"MetricsRecorder": MetricsRecorder, "ToyConfig": ToyConfig, "replace": replace,
            "run_ring": run_ring, "exercises": exercises, "rec": rec,
            "result": summarize(rec, ToyConfig(), wall_s=1.0),
            "cfg": ToyConfig.smoke(), "EXPERIMENT_STEPS": 12}


def per_step_means(r: MetricsRecorder) -> dict:
    """Wrong: each step's mean staleness, credited to every generator in that step."""
    out: dict = {}
    for row in r.rows("step"):
        for src in set(row["sources"]):
            out.setdefault(src, []).append(statistics.fmean(row["staleness"]))
    return {s: statistics.fmean(v) for s, v in out.items()}


def test_02_ex1_staleness_by_generator(learning_mode: None) -> None:
    async def scenario() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            ns = await run_cells(NB02, ["9c8ecb19", "e1c7a2b4"], namespace_02())
        right = solution("02_ex1", ns, "staleness_by_generator")
        assert right(ns["rec"]) == {"gen0": 0.8, "gen1": 1.5, "gen2": 3.0}
        off_by = {d: (lambda r, d=d: {s: v + d for s, v in right(r).items()}) for d in (5, 0.01)}
        await judge("02_ex1", ns["staleness_problems"], ns, "staleness_by_generator",
                    {"off by 5": off_by[5], "off by 0.01": off_by[0.01],
                     "per-step means": per_step_means,
                     "generator indices": lambda r: dict(enumerate(right(r).values()))})

    asyncio.run(scenario())


def test_02_ex2_on_policy_config(learning_mode: None) -> None:
    """Each wrong answer removes one source of staleness (section 5) and keeps the other."""
    async def scenario() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            ns = await run_cells(NB02, ["961826f9", "5b0d7c2e"], namespace_02())
        checker = ns["on_policy_problems"]
        await judge("02_ex2", checker, ns, "on_policy_config", {
            "unchanged": lambda c: c,
            "weights to all, running ahead": lambda c: replace(c, selection="all"),
            "one generator, running ahead": lambda c: replace(c, generators=1),
            "sync, weights to one of four": lambda c: replace(c, mode="sync"),
            "max_ahead=0, weights to one of four": lambda c: replace(c, max_ahead=0),
            "not a config": lambda c: {"mode": "sync", "generators": 1},
        })
        # other right answers pass too: the checker tests staleness, not the solution's text
        for right in (lambda c: replace(c, mode="sync", selection="all"),
                      lambda c: replace(c, max_ahead=0, generators=1)):
            assert await verdict("02_ex2", checker, right)

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def ns_03() -> dict[str, Any]:
    """Notebook 03 up to its three checkers (section 7's one_step, each stub, each checker)."""
    cells = ["7b469c85", "cb4baad5", "0e78a593", "9e2c41a7", "0ee6632c", "4b7d20e3",
             "65256516", "0c03ef9e"]
    with contextlib.redirect_stdout(io.StringIO()):
        return asyncio.run(run_cells(NB03, cells, {}))


def test_03_ex1_fixed_loss(ns_03: dict[str, Any], learning_mode: None) -> None:
    def raise_every_answer(logp: Any, old: Any, adv: Any, mask: Any) -> Any:
        return -(torch.exp(logp - old) * mask).sum(-1).mean()  # the advantage left out

    asyncio.run(judge("03_ex1", ns_03["sign_problems"], ns_03, "fixed_loss",
                      {"buggy_loss itself": ns_03["buggy_loss"],
                       "advantage left out": raise_every_answer}))


def test_03_ex2_k3(ns_03: dict[str, Any], learning_mode: None) -> None:
    def k3_reversed(logp: Any, ref_logp: Any) -> Any:
        log_rho = logp - ref_logp  # the ratio upside down: still ≥ 0, another divergence
        return torch.exp(log_rho) - 1 - log_rho

    asyncio.run(judge("03_ex2", ns_03["k3_problems"], ns_03, "my_k3",
                      {"ratio upside down": k3_reversed,
                       "k2": lambda lp, rp: (lp - rp) ** 2 / 2}))


def test_03_ex3_dual_clip(ns_03: dict[str, Any], learning_mode: None) -> None:
    def ppo_clip(r: Any, a: Any, eps: float = 0.2, c: float = 3.0) -> Any:
        return -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)

    def dual_clip_both_signs(r: Any, a: Any, eps: float = 0.2, c: float = 3.0) -> Any:
        return -torch.maximum(-ppo_clip(r, a, eps), c * a)  # caps positive advantages too

    asyncio.run(judge("03_ex3", ns_03["dual_clip_problems"], ns_03, "my_dual_clip_loss",
                      {"plain PPO-clip": ppo_clip, "dual-clip for both signs": dual_clip_both_signs}))


def notebooks_calling_check() -> dict[str, set[str]]:
    found = {}
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
        if names := set(re.findall(r"exercises\.check\(\"([^\"]+)\"", text)):
            found[path.name] = names
    return found


def test_solutions_live_in_files_not_in_the_notebook() -> None:
    """Run all never runs a solution: solution cells only point at their file."""
    called = notebooks_calling_check()
    assert {NB01, NB02, NB03} <= set(called)
    files = {p.stem for p in SOLUTIONS.glob("*.py")}
    assert set().union(*called.values()) == files, "a solution file without its check, or back"
    for name in called:
        for cell in nbformat.read(NOTEBOOKS / name, as_version=4).cells:
            if "solution" in cell.get("metadata", {}).get("tags", []):
                code = [ln for ln in cell.source.splitlines() if not ln.lstrip().startswith("#")]
                assert code == [], f"{name}: a solution cell runs code: {code}"
                assert re.search(r"^# %load solutions/\w+\.py$", cell.source, re.M), cell.source


def test_ci_mode_runs_the_solution_and_fails_loudly(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPO_NB_SOLUTIONS=1: the checker cell loads solutions/<ex>.py and raises if it fails."""
    ns: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        asyncio.run(run_cells(NB03, ["7b469c85", "0ee6632c"], ns))
    monkeypatch.setenv("GRPO_NB_SOLUTIONS", "1")
    monkeypatch.chdir(NOTEBOOKS)  # the kernel's working directory
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        asyncio.run(run_cells(NB03, ["4b7d20e3"], ns))
    assert out.getvalue().startswith("✓ 03_ex2"), out.getvalue()
    # a wrong solution file: the same cell raises, naming the file and what is wrong
    (tmp_path / "solutions").mkdir()
    wrong = (SOLUTIONS / "03_ex2.py").read_text().replace("ref_logp - logp", "logp - ref_logp")
    (tmp_path / "solutions" / "03_ex2.py").write_text(wrong)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssertionError, match=r"solutions/03_ex2\.py fails its checker"):
        asyncio.run(run_cells(NB03, ["4b7d20e3"], ns))
    monkeypatch.setenv("GRPO_NB_SOLUTIONS", "0")  # learning mode: the same answer only prints ✗
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        asyncio.run(run_cells(NB03, ["4b7d20e3"], ns))
    assert out.getvalue().startswith("✗ 03_ex2") and "%load solutions/03_ex2.py" in out.getvalue()
