"""Each exercise's checker, run without a server: the unsolved stub fails it, a plausible wrong
answer fails it, a right answer passes.

The checker is the notebook's own cell (found by its id) executed against a namespace that
holds what the notebook would have computed by then, built by hand: metric rows, completions,
groups, and the tests' fake vLLM server (fake_vllm.py) where a cell talks to a server.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import io
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nbformat
import pytest
import torch
from fake_vllm import FakeVLLM, Sample

from grpo_nb import actors, tasks
from grpo_nb.actors import Actor, Channel, concurrent_endpoint, endpoint
from grpo_nb.config import preset
from grpo_nb.course import exercises
from grpo_nb.llm import by_hand, rollouts
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, Prompt
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.serving.client import ClientConfig, CompletionsClient
from grpo_nb.serving.control import VLLMControlClient
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


# ── 04 · Exercises 1–3: temperature and mixed groups; a format bonus; aborted requests ──
# The checkers and the solutions run unchanged against the tests' fake server (fake_vllm.py),
# through the package's own completions and control clients.

NB04 = "04_vllm_rollouts.ipynb"
ROWS_04 = [(f"00{k}+001=", f"000{k + 1}") for k in range(5)]


def section4_samples(prompt: list[int], params: dict[str, Any]) -> list[Sample]:
    """Section 4's server by hand. At T < 1 a group's samples agree (right for the first prompt
    only); at T ≥ 1 they differ: right, a bare wrong number, two badly shaped. Every token's
    log-prob is the stand-in model's at T, ``-0.3 * T``."""
    t, n, k = float(params.get("temperature", 1.0)), int(params.get("n", 1)), prompt[-1]
    if t < 1:
        texts = [ROWS_04[k][1] if k == 0 else "7"] * n
    else:
        texts = [[ROWS_04[k][1], "7", "no", "12 13"][i % 4] for i in range(n)]
    ends = "length" if params.get("ignore_eos") else "stop"
    return [Sample(text, [5, 6], [-0.3 * t] * 2, ends) for text in texts]


def section4_server(decode_s: float = 0.0, burst: int = 1) -> FakeVLLM:
    """The fake server answering as section 4's; each request decodes for ``decode_s``."""
    return FakeVLLM(sampler=section4_samples, decode_s=decode_s, burst=burst)


def namespace_04(fake: FakeVLLM) -> dict[str, Any]:
    """Notebook 04 at its exercises, with ``fake`` as its server."""
    cfg = LLMConfig(model="Qwen/Qwen3-0.6B", dataset="arithmetic", group_size=4)  # not loaded
    return {"exercises": exercises, "rollouts": rollouts, "tasks": tasks, "Group": Group,
            "prompts": [Prompt(p, [1, k], a) for k, (p, a) in enumerate(ROWS_04)],
            "group_size": cfg.group_size, "cfg": cfg, "score": tasks.make_reward("math"),
            "server": fake, "client": CompletionsClient.for_server(fake), "prompt_ids": [1, 0],
            "ClientConfig": ClientConfig, "CompletionsClient": CompletionsClient,
            "VLLMControlClient": VLLMControlClient,
            "temperature_gap": lambda samples, t: max(abs(x + 0.3 * t) for *_, lp in samples
                                                      for x in lp)}  # section 5's, for the fake


async def at_exercise_04(stub: str, checker: str, fake: FakeVLLM) -> dict[str, Any]:
    with contextlib.redirect_stdout(io.StringIO()):  # the checker's ✗ for the stub
        return await run_cells(NB04, [stub, checker], namespace_04(fake))


def variants(exercise: str, ns: dict[str, Any], name: str,
             edits: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Plausible wrong answers: the solution with one piece of its text replaced."""
    text = (SOLUTIONS / f"{exercise}.py").read_text(encoding="utf-8")
    out = {}
    for label, (old, new) in edits.items():
        assert old in text, (exercise, old)
        scope = dict(ns)
        exec(compile(text.replace(old, new), f"{exercise}: {label}", "exec"), scope)
        out[label] = scope[name]
    return out


def judge_04(exercise: str, cells: tuple[str, str], checker: str, name: str,
             edits: dict[str, tuple[str, str]]) -> None:
    """Run 04 on a fake server up to ``cells``, then judge ``name`` and its wrong ``edits``."""

    async def scenario() -> None:
        with section4_server() as fake:
            ns = await at_exercise_04(*cells, fake)
            await judge(exercise, ns[checker], ns, name, variants(exercise, ns, name, edits))

    asyncio.run(scenario())


def test_04_ex1_mixed_groups_against_temperature(learning_mode: None) -> None:
    sample = "cfg.replace(temperature=t)"
    judge_04("04_ex1", ("98bb0862", "a4c91e07"), "mixed_problems", "mixed_at_temperature", {
        "counts, not fractions": ("mixed / len(groups)", "mixed"),
        "sampled at one temperature": (sample, "cfg"),
        "temperatures swapped": (sample, "cfg.replace(temperature=1.8 - t)"),
        "not scored": ("reward=score", "reward=None"),
    })


def test_04_ex2_format_bonus(learning_mode: None) -> None:
    """The groups: wrong prompts or reward fail. The exploit, `never_right(answer)`: a right
    answer in any spelling fails, so does one that earns nothing; any paid wrong answer passes."""

    async def scenario() -> None:
        with section4_server() as fake:
            ns = await at_exercise_04("abd6c76d", "b83d5f16", fake)
            await judge_bonus(ns)

    async def judge_bonus(ns: dict[str, Any]) -> None:
        checker = ns["bonus_problems"]
        groups, exploit = (solution("04_ex2", ns, n) for n in ("bonus_groups", "never_right"))
        assert not await verdict("04_ex2", checker, groups), "the stub never_right passes"
        ns["never_right"] = exploit
        spec = 'tasks.make_reward("math+0.2*format")'
        await judge("04_ex2", checker, ns, "bonus_groups", variants("04_ex2", ns, "bonus_groups", {
            "no bonus": (spec, "score"),
            "the 0.1 bonus": (spec, 'tasks.make_reward("math+0.1*format")'),
            "too few prompts": ("prompts[:4]", "prompts[:2]"),
            "every prompt": ("prompts[:4]", "prompts"),
            "the last four prompts": ("prompts[:4]", "prompts[-4:]"),
            "four prompts from the second": ("prompts[:4]", "prompts[1:5]"),
            "the first four in another order": ("prompts[:4]", "prompts[3::-1]"),
            "groups of 2": ("cfg,", "cfg.replace(group_size=2),"),
        }))
        for label, wrong in {
                "the answer itself": lambda a: a,
                "the answer without its leading zeros": lambda a: a.lstrip("0") or "0",
                "minus the answer (right for a zero)": lambda a: "-" + a,
                "a fixed 7 (right for 0007)": lambda a: "7",
                "the right answer boxed": lambda a: f"\\boxed{{{a}}}",
                "words": lambda a: "I do not know",
                "a wrong number in a sentence": lambda a: f"The answer is {int(a) + 1}.",
                "two numbers": lambda a: f"{a} {int(a) + 1}",
                "an int, not a completion": lambda a: int(a) + 1,
        }.items():
            ns["never_right"] = wrong
            assert not await verdict("04_ex2", checker, groups), f"never_right: {label} passes"
        for other in (lambda a: a + "1", lambda a: "\\boxed{?}", exploit):  # paid, never right
            ns["never_right"] = other
            assert await verdict("04_ex2", checker, groups), "a right never_right fails"

    asyncio.run(scenario())


def test_04_ex3_abort_requests_in_flight(learning_mode: None) -> None:
    async def scenario() -> None:
        # burst=8: the gauge shows the exercise's 8 requests once all decode, as a server
        # that got them in one burst would (a request written after the pause would wait for
        # a resume that comes after it)
        with section4_server(decode_s=2.0, burst=8) as fake:
            await judge_abort(fake, await at_exercise_04("8f504de9", "e4bb2efe", fake))

    async def judge_abort(fake: FakeVLLM, ns: dict[str, Any]) -> None:
        wait = "await asyncio.to_thread(control.wait_running, n, 60.0)"
        wrong = variants("04_ex3", ns, "count_aborted", {
            "a fixed sleep, longer than the requests": (wait, "await asyncio.sleep(6.0)"),
            "paused before the requests reach the server":
                (f'{wait}\n        control.pause("abort")',
                 'control.pause("abort")\n        control.resume()'),
            "never resumes": ("control.resume()  #", "pass  #"),
        })
        await judge("04_ex3", ns["abort_problems"], ns, "count_aborted", wrong)
        assert not fake.paused, "the checker resumes a server an answer left paused"
        fake.requests.clear()
        assert await solution("04_ex3", ns, "count_aborted")(8) == (8, 0)
        assert "/metrics" in fake.calls, "the solution waits on the server's gauge (wait_running)"

    asyncio.run(scenario())


# ── 05 · Exercises 1, 3 and 4: the masked token loss, a staleness budget of zero, an aborting sync ──

NB05 = "05_async_grpo.ipynb"


def test_05_ex1_token_loss(learning_mode: None) -> None:
    assert 'exercises.check("05_ex1", by_hand.token_loss_problems' in cell_source(NB05, "842d7b29")

    def per_sample_mean(logp: Any, old: Any, adv: Any, mask: Any, eps: float = 0.2) -> Any:
        ratio, a = torch.exp(logp - old), adv[:, None]
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        return -((surrogate * mask).sum(-1) / mask.sum(-1)).mean()  # "seq-mean", not token-mean

    def no_mask(logp: Any, old: Any, adv: Any, mask: Any, eps: float = 0.2) -> Any:
        ratio, a = torch.exp(logp - old), adv[:, None]
        return -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a).mean()  # padding too

    ns: dict[str, Any] = {}
    exec(cell_source(NB05, "ab7ac75a"), ns)
    asyncio.run(judge("05_ex1", by_hand.token_loss_problems, ns, "my_token_loss",
                      {"a mean per sample first": per_sample_mean, "no mask": no_mask}))


def test_05_ex3_stale0_config(learning_mode: None) -> None:
    async def scenario() -> None:
        ns = {"cfg": preset(LLMConfig).replace(dtype="float32").resolve()}  # as the notebook's
        with contextlib.redirect_stdout(io.StringIO()):
            ns = await run_cells(NB05, ["29ba6a79", "af63411e"], ns)
        await judge("05_ex3", ns["stale0_problems"], ns, "stale0_config", {
            "max_staleness=1": lambda c: c.replace(max_staleness=1, steps=10),
            "sync mode": lambda c: c.replace(mode="sync", max_staleness=0, steps=10),
            "the whole run": lambda c: c.replace(max_staleness=0),
            "another knob changed": lambda c: c.replace(max_staleness=0, steps=10, max_ahead=0),
            "not a config": lambda c: {"max_staleness": 0, "steps": 10},
        })
        assert await verdict("05_ex3", ns["stale0_problems"],  # another right answer
                             lambda c: c.replace(max_staleness=0, steps=3, mode="async"))

    asyncio.run(scenario())


def completion(finish_reason: str, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(finish_reason=finish_reason, token_ids=list(range(tokens)), text="",
                           logprobs=[-1.0] * tokens)


def test_05_ex4_sync_aborts_requests_in_flight(learning_mode: None, fake_vllm: FakeVLLM) -> None:
    """The server's label starts at "1" (section 4's sync): the checker must not trust it.
    Exercise 4's checker reads only the served weight version (through its control client)."""
    fake_vllm.weight_version = "1"

    def answer(outs: list, syncs: bool) -> Callable[[], Any]:
        async def aborted_completions() -> list:
            if syncs:
                fake_vllm.weight_version = "1"
            return outs

        return aborted_completions

    async def scenario() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            ns = await run_cells(NB05, ["fd8d7eba", "7d43909b"], {"server": fake_vllm})
        checker = ns["abort_problems"]
        assert not await verdict("05_ex4", checker, ns["aborted_completions"]), "the stub"
        cut = [completion("abort", n) for n in (12, 12, 13, 13, 13, 14)]
        outs = [*cut, completion("length", 200), completion("length", 200)]
        for name, wrong in [
            ("every completion, not only the aborted", answer(outs, True)),
            ("every completion, without ignore_eos", answer([*cut, completion("stop", 6)], True)),
            ("a run that never synced: nothing aborted", answer([], False)),
            ("a run that never synced: all finished", answer(outs[-2:], False)),
            ("paused by hand, never synced", answer(cut, False)),
            ("a completion kept twice", answer(cut + cut, True)),
            ("a plain function, not async", lambda: cut),
        ]:
            assert not await verdict("05_ex4", checker, wrong), name
        assert await verdict("05_ex4", checker, answer(cut, True)), "right"
        # the solution needs a live server: make nbtest runs it through this checker
        # (GRPO_NB_SOLUTIONS=1); here, that it defines the coroutine function the checker awaits
        assert inspect.iscoroutinefunction(solution("05_ex4", {}, "aborted_completions"))

    asyncio.run(scenario())


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


class WrongQueue(Actor):
    """A queue with one of Exercise 3's mistakes, chosen by its class attributes."""

    bound: int | None = None  # None: never waits while full
    take = 0  # the index get() hands out: 0 the oldest, -1 the newest

    def __init__(self, capacity: int) -> None:
        self.items: list = []
        self.most = 0
        self.changed = asyncio.Condition()

    @concurrent_endpoint
    async def put(self, item: Any) -> None:
        async with self.changed:
            if self.bound is not None:
                await self.changed.wait_for(lambda: len(self.items) < self.bound)
            self.items.append(item)
            self.most = max(self.most, len(self.items))
            self.changed.notify_all()

    @concurrent_endpoint
    async def get(self) -> Any:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.items) > 0)
            item = self.items.pop(self.take)
            self.changed.notify_all()
            return item

    @endpoint
    async def high_water(self) -> int:
        return self.most


class UnboundedQueue(WrongQueue):
    """Forgets to wait while full: every put returns at once."""


class NewestFirstQueue(WrongQueue):
    """Bounded, but hands out the newest item."""

    bound, take = 3, -1


def test_01_ex3_bounded_queue(learning_mode: None) -> None:
    async def scenario() -> None:
        ns = await run_cells(NB01, [*SETUP_01, "a72d4005", "04727925"], {})
        await judge("01_ex3", ns["queue_problems"], ns, "BoundedQueue",
                    {"unbounded": UnboundedQueue, "newest first": NewestFirstQueue})

    asyncio.run(scenario())


# 02: mean staleness per generator; an on-policy ring
NB02 = "02_toy_grpo_ring.ipynb"
# As in the notebook's main run, every generator sent as many groups: there the run's weighted
# mean alone cannot tell the right means from the same means under other generators, or from the
# run's mean for each. The checker's own made-up run has unequal numbers of groups.
STEPS_02 = [(["gen0", "gen1"], [0, 2]), (["gen1", "gen0"], [3, 1]), (["gen0", "gen1"], [1, 2]),
            (["gen1", "gen0"], [1, 2])]


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


def per_step_then_mean(r: MetricsRecorder) -> dict:
    """Wrong: a generator's groups averaged within each step first, then those means averaged."""
    out: dict = {}
    for row in r.rows("step"):
        mine: dict = {}
        for src, s in zip(row["sources"], row["staleness"], strict=True):
            mine.setdefault(src, []).append(s)
        for src, v in mine.items():
            out.setdefault(src, []).append(statistics.fmean(v))
    return {s: statistics.fmean(v) for s, v in out.items()}


def test_02_ex1_staleness_by_generator(learning_mode: None) -> None:
    async def scenario() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            ns = await run_cells(NB02, ["9c8ecb19", "e1c7a2b4"], namespace_02())
        right = solution("02_ex1", ns, "staleness_by_generator")
        assert right(ns["rec"]) == {"gen0": 1.0, "gen1": 2.0}
        assert right(ns["made_up"]) == {"gen0": 0.8, "gen1": 1.5, "gen2": 3.0}

        def rotated(r: MetricsRecorder) -> dict:  # the right means, each under the next generator
            means = right(r)
            keys = sorted(means)
            return {k: means[keys[i - 1]] for i, k in enumerate(keys)}

        def run_mean(r: MetricsRecorder) -> dict:
            every = [s for row in r.rows("step") for s in row["staleness"]]
            return dict.fromkeys(right(r), statistics.fmean(every))

        off_by = {d: (lambda r, d=d: {s: v + d for s, v in right(r).items()}) for d in (5, 0.01)}
        main_run = right(ns["rec"])
        await judge("02_ex1", ns["staleness_problems"], ns, "staleness_by_generator", {
            "the means permuted": rotated,
            "the run's mean for every generator": run_mean,
            "the means of the main run, hard-coded": lambda r: dict(main_run),
            "per-step means": per_step_means,
            "per-step means of each generator's groups, then averaged": per_step_then_mean,
            "the stalest group of each": lambda r: {s: max(v) for s, v in
                                                    ns["groups_by_source"](r).items()},
            "off by 5": off_by[5], "off by 0.01": off_by[0.01],
            "generator indices": lambda r: dict(enumerate(right(r).values())),
            "strings": lambda r: {s: str(v) for s, v in right(r).items()},
        })
        # what the learner reads for those two
        for wrong, why in ((rotated, "under the wrong generators"), (run_mean, "the run's mean")):
            assert any(why in p for p in ns["staleness_problems"](wrong)), why

        def by_counters(r: MetricsRecorder) -> dict:  # another right answer, written otherwise
            total, count = Counter(), Counter()
            for row in r.rows("step"):
                for src, s in zip(row["sources"], row["staleness"], strict=True):
                    total[src] += s
                    count[src] += 1
            return {src: total[src] / count[src] for src in count}

        assert await verdict("02_ex1", ns["staleness_problems"], by_counters)

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
    """Run all never runs a solution: solution cells only point at their file; a written answer
    is folded in <details>."""
    called = notebooks_calling_check()
    assert {NB01, NB02, NB03, NB04, NB05, NB06} <= set(called)
    files = {p.stem for p in SOLUTIONS.glob("*.py")}
    assert set().union(*called.values()) == files, "a solution file without its check, or back"
    for name in called:
        for cell in nbformat.read(NOTEBOOKS / name, as_version=4).cells:
            if "solution" not in cell.get("metadata", {}).get("tags", []):
                continue
            if cell.cell_type == "markdown":  # a written answer: folded, opened on purpose
                assert re.match(r"<details><summary>.*</summary>\n", cell.source), cell.source
                assert cell.source.rstrip().endswith("</details>"), cell.source
            else:
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


# 05 · Exercise 2: the trainer's admission rule and its credits
NB05_ADMIT = "05_async_grpo.ipynb", ["35c06b92", "92d0efcf"]  # the stub, the checker


def test_05_ex2_admit_and_credits(learning_mode: None) -> None:
    """Wrong rules fail (strict bound, staleness the wrong way round, a number for a bool); wrong
    credits fail (received left out, running ahead in sync mode, the current step left out)."""
    async def scenario() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            ns = await run_cells(*NB05_ADMIT, {})
        checker = ns["admission_problems"]
        assert not await verdict("05_ex2", checker, ns["admit"]), "the stub passes"
        right = solution("05_ex2", ns, "admit")
        ns["issued"] = solution("05_ex2", ns, "issued")
        for label, wrong in {"<": lambda s, v, m: s - v < m,
                             "wrong way round": lambda s, v, m: v - s <= m,
                             "the staleness": lambda s, v, m: s - v,
                             "one more allowed": lambda s, v, m: s - v <= m + 1}.items():
            assert not await verdict("05_ex2", checker, wrong), f"admit {label} passes"
        for label, wrong in {
                "received left out": lambda r, mode, a, p: (1 + a) * p,
                "ahead in sync mode": lambda r, mode, a, p: r + (1 + a) * p,
                "this step left out": lambda r, mode, a, p: r + (a if mode == "async" else 1) * p,
        }.items():
            ns["issued"] = wrong
            assert not await verdict("05_ex2", checker, right), f"issued {label} passes"
        ns["issued"] = solution("05_ex2", ns, "issued")
        assert await verdict("05_ex2", checker, right), "the solution fails"

    asyncio.run(scenario())


def test_05_walkthrough_quotes_the_running_code() -> None:
    """05's walk-through of the trainer's loop quotes its lines (every backticked span with a
    call in its two markdown cells): each must be in the source its code cells print."""
    from grpo_nb import ring_core
    from grpo_nb.llm import actors as llm_actors

    printed = [llm_actors.Trainer._train, llm_actors.Trainer.keep, ring_core.Ledger.take,
               ring_core.admit, ring_core.Ledger.refill, ring_core.issued, llm_actors.Learner.sync]
    for cell_id in ("5e0c7a12", "5e0c7a14"):  # the cells print exactly these
        names = re.findall(r"getsource\(([\w.]+)\)", cell_source(NB05, cell_id))
        assert names, cell_id
    code = " ".join(" ".join(inspect.getsource(f).split()) for f in printed)
    quoted = [q for cell_id in ("5e0c7a11", "5e0c7a13")
              for q in re.findall(r"`([^`]+)`", cell_source(NB05, cell_id)) if "(" in q]
    assert len(quoted) >= 8, quoted
    for q in quoted:
        for piece in " ".join(q.split()).split("…"):
            piece = piece.strip(" ,)")
            if piece:
                assert piece in code or piece.rstrip(")") in code, f"not in the code: {piece!r}"


def test_05_self_check_names_the_sections_not_run() -> None:
    """05's self-check with only section 1 run: section 1 is checked, every other section is
    named with the names it would define (no NameError escapes); a failing check still fails."""
    source = cell_source(NB05, "d0f33051")
    ns: dict[str, Any] = {"sync_cfg": SimpleNamespace(pause_mode="none"), "device": "cpu"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(RuntimeError) as err:
        exec(source, ns)
    assert "✓ section 1" in out.getvalue(), out.getvalue()
    message = str(err.value)
    for where, name in [("section 3 (", "nudged_gap"), ("section 4 (", "fresh_gap"),
                        ("section 6 (", "res_async"), ("section 7 (", "res_sync"),
                        ("Exercise 3's run", "res0")]:
        assert where in message and name in message, (where, message)
    assert "section 1" not in message, message
    ns = {"sync_cfg": SimpleNamespace(pause_mode="none"), "device": "cuda:0"}  # wrong: a GPU
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(AssertionError):
        exec(source, ns)


# 06 · Exercise 1: the cost of starting a mesh. A fake Monarch stands in for processes that start
# in the background and answer only once up (spawning returns at once, as Monarch's does); the
# asyncio runtime is the real one.
NB06 = "06_scale_out_with_monarch.ipynb"
FAKE_START_S = 0.3  # a fake process's start


class FakeMonarch:
    """``monarch.actor`` by hand: ``this_host().spawn_procs(...).spawn(...)`` returns at once, and
    ``mesh.echo.call`` answers once the processes have started."""

    def this_host(self) -> FakeMonarch:
        return self

    def spawn_procs(self, per_host: dict[str, int]) -> FakeMonarch:
        self.up = asyncio.get_running_loop().time() + FAKE_START_S
        return self

    def spawn(self, name: str, cls: type) -> FakeMonarch:
        self.echo = SimpleNamespace(call=self.call, choose=self.call)
        return self

    async def call(self, x: Any) -> Any:
        await asyncio.sleep(self.up - asyncio.get_running_loop().time())
        return x

    async def stop(self) -> None:
        return None


class Echo(Actor):
    @endpoint
    async def echo(self, x: Any) -> Any:
        return x


def namespace_06(monarch: bool = True) -> dict[str, Any]:
    """Notebook 06 at its exercise: its runtimes (asyncio, and the fake Monarch if ``monarch``),
    section 1's measured start (2 processes)."""
    fake = FakeMonarch()
    backends = {"asyncio": actors.backend("asyncio"), **({"monarch": fake} if monarch else {})}
    return {"exercises": exercises, "time": time, "asyncio": asyncio, "endpoint": endpoint,
            "Echo": Echo, "RUNTIMES": list(backends),
            "actors": SimpleNamespace(backend=backends.__getitem__),
            "class_for": lambda cls, api: cls if api is fake else actors.class_for(cls, api),
            "costs": {"asyncio": {"start_s": 1e-4}, "monarch": {"start_s": FAKE_START_S}}}


NOT_CHECKED_06 = "Not checked without Monarch"


@pytest.mark.parametrize("monarch", [True, False], ids=["fake Monarch", "without Monarch"])
def test_06_ex1_start_cost(learning_mode: None, monarch: bool) -> None:
    """Without Monarch the checker still fails these wrong answers, on asyncio with a stand-in
    Echo that takes a set time to answer, and prints what it could not check."""
    async def scenario() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            ns = await run_cells(NB06, ["e63f72c3", "0ce58591"], namespace_06(monarch))
        wait = "    await mesh.echo.call(0)\n    elapsed = time.perf_counter() - t0\n"
        wrong = variants("06_ex1", ns, "start_cost", {
            "the spawn only, not the first answer":
                (wait, "    elapsed = time.perf_counter() - t0\n    await mesh.echo.call(0)\n"),
            "milliseconds": ("return elapsed", "return elapsed * 1000"),
            "an int": ("return elapsed", "return round(elapsed)"),
            "one process whatever n": ('per_host={"gpus": n}', 'per_host={"gpus": 1}'),
            "one actor's answer": ("mesh.echo.call(0)", "mesh.echo.choose(0)"),
            "never stopped": ("    await mesh.stop()\n    await procs.stop()\n", ""),
            "section 1's number, not measured": ("return elapsed", 'return costs[name]["start_s"]'),
            "a fixed guess": ("return elapsed", "return 0.5"),
        })
        await judge("06_ex1", ns["start_cost_problems"], ns, "start_cost", wrong)
        assert ns["Echo"] is Echo, "the checker puts the notebook's Echo back"
        # the whole checker cell, on the solution: ✓, and without Monarch what was not checked
        ns["start_cost"] = solution("06_ex1", ns, "start_cost")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            await run_cells(NB06, ["0ce58591"], ns)
        assert out.getvalue().startswith("✓ 06_ex1"), out.getvalue()
        assert (NOT_CHECKED_06 in out.getvalue()) is not monarch, out.getvalue()

    asyncio.run(scenario())
