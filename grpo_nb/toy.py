"""The toy GRPO ring: a contextual bandit learned by K generators, a scorer, a reference and a
trainer that talk through ports — on ``grpo_nb.actors`` (one process) or torchmonarch.

The task (a stand-in for "answer the prompt correctly"): a state ``s ∈ R^obs_dim`` is drawn
at random; the policy picks one of ``arms`` actions; the reward is 1 when it picks the arm a
fixed hidden *teacher* ``W*`` prefers (``argmax W* s``), else 0. A random policy earns
``1/arms``; the best policy earns exactly **1.0** (the teacher is linear, the policy an MLP
that can represent it), so the plot shows the gap to a known optimum closing. The trainer
also records ``expected_reward``: the exact expected reward of its current policy on a fixed
set of evaluation states (no sampling noise).

::

    run_ring(cfg) ── spawns ──► Generator x K ─► Scorer ─► Reference ─► Trainer
        ▲                            ▲  (weights, selection="choose")      │
        │                            └─────────────────────────────────────┘
        └──── Event("step" | "busy" | "exited" | "error") ◄── every actor (metrics port)
              └─► MetricsRecorder (runs/<name>/metrics.jsonl) ─► on_step (live plot, tqdm)

The GRPO math is :mod:`grpo_nb.grpo` (one implementation for the whole package). The actors
themselves are in :mod:`grpo_nb.toy_actors`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

from grpo_nb.config import smoke_mode
from grpo_nb.metrics import MetricsRecorder
from grpo_nb.ring import Event as Event  # the metrics-port message (re-exported)

Backend = Literal["asyncio", "monarch"]


@dataclass(frozen=True)
class ToyConfig:
    """Everything the toy ring needs. ``ToyConfig.smoke()`` is the CI size."""

    steps: int = 400
    generators: int = 4
    group_size: int = 8  # G samples of the same state form one GRPO group
    groups_per_step: int = 4  # groups per trainer step (batch B = groups_per_step x G)
    obs_dim: int = 4
    arms: int = 4
    hidden: int = 32
    lr: float = 0.02
    clip: float = 0.2
    kl_coef: float = 0.02
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    seed: int = 0
    # Simulated decoding time per group. Without it the generators would flood the trainer
    # (sampling 8 actions from a tiny MLP takes microseconds, unlike an LLM).
    gen_delay_s: float = 0.02
    # Flow control. k: a generator waits before its n-th group until the trainer has reached
    # version n * generators // groups_per_step - k (its share of the work may run k steps
    # ahead). None: no pacing at all (the queue grows without bound when generators are faster
    # than the trainer). With one generator, 0 is on-policy and deterministic.
    max_lag: int | None = 2
    eval_states: int = 512
    backend: Backend = "asyncio"
    # "per_role": a process mesh per role (K + 3 processes on Monarch, as in Monarch's example);
    # "shared": generators on one mesh, scorer + reference + trainer share one process (K + 1).
    # Starting a process costs seconds (Python + torch imports), so "shared" starts faster.
    layout: Literal["per_role", "shared"] = "per_role"

    def __post_init__(self) -> None:
        for name in ("steps", "generators", "group_size", "groups_per_step", "obs_dim", "hidden", "eval_states"):
            if getattr(self, name) < 1:
                raise ValueError(f"ToyConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"ToyConfig.group_size must be >= 2 (a group needs a spread), got {self.group_size}")
        if self.arms < 2:
            raise ValueError(f"ToyConfig.arms must be >= 2, got {self.arms}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"ToyConfig.lr must be a positive number, got {self.lr}")
        if not 0 <= self.clip < 1:
            raise ValueError(f"ToyConfig.clip must be in [0, 1), got {self.clip}")
        if self.kl_coef < 0:
            raise ValueError(f"ToyConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise ValueError(f"ToyConfig.kl_kind must be k1, k2 or k3, got {self.kl_kind!r}")
        if self.gen_delay_s < 0:
            raise ValueError(f"ToyConfig.gen_delay_s must be >= 0, got {self.gen_delay_s}")
        if self.max_lag is not None and self.max_lag < 0:
            raise ValueError(f"ToyConfig.max_lag must be None or >= 0, got {self.max_lag}")
        if self.layout not in ("per_role", "shared"):
            raise ValueError(f"ToyConfig.layout must be 'per_role' or 'shared', got {self.layout!r}")
        if self.backend not in ("asyncio", "monarch"):
            raise ValueError(f"ToyConfig.backend must be 'asyncio' or 'monarch', got {self.backend!r}")

    @classmethod
    def smoke(cls) -> ToyConfig:
        """Small enough for CI (a few seconds), large enough to learn visibly."""
        # gen_delay_s keeps the notebook's live run going for a few seconds even on fast CPUs.
        return cls(steps=100, gen_delay_s=0.03)

    @property
    def optimum(self) -> float:
        """Best achievable expected reward: always picking the teacher's arm pays 1."""
        return 1.0

    @property
    def random_reward(self) -> float:
        """Expected reward of the uniform policy."""
        return 1.0 / self.arms


@dataclass
class Group:
    """One GRPO group travelling around the ring; each stage fills in its field."""

    obs: torch.Tensor  # [obs_dim] the shared "prompt"
    actions: torch.Tensor  # [G] long
    logprobs: torch.Tensor  # [G] under the generating policy
    version: int  # weights version of that policy (staleness = trainer version - version)
    source: str  # which generator
    created: float  # wall-clock time.time() when sent
    rewards: torch.Tensor | None = None  # [G] filled by the scorer
    ref_logprobs: torch.Tensor | None = None  # [G] filled by the reference


def build_policy(cfg: ToyConfig) -> nn.Module:
    return nn.Sequential(nn.Linear(cfg.obs_dim, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, cfg.arms))


def build_teacher(cfg: ToyConfig) -> torch.Tensor:
    """The hidden ``W*`` [arms, obs_dim]: the same for every actor that builds it from cfg."""
    gen = torch.Generator().manual_seed(10_007 + cfg.seed)
    return torch.randn(cfg.arms, cfg.obs_dim, generator=gen)


def best_arm(teacher: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
    """The paying arm for each state: ``argmax W* s`` (works for [obs_dim] and [N, obs_dim])."""
    return (obs @ teacher.T).argmax(dim=-1, keepdim=obs.dim() == 1)


def policy_logprobs(policy: nn.Module, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """log π(a|s) for actions [..., G] taken in states [..., obs_dim] (one state per group)."""
    logp_all = torch.log_softmax(policy(obs), dim=-1)
    return logp_all.gather(-1, actions)


@dataclass
class RingResult:
    """Summary figures of a finished ring run."""

    backend: str
    steps: int
    wall_s: float
    steps_per_s: float
    optimum: float
    random_reward: float
    first_reward: float  # mean sampled reward over the first 10% of steps
    last_reward: float  # ... and over the last 10%
    expected_reward_final: float
    staleness_mean: float
    staleness_max: int
    dropped: int
    run_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def summarize(rec: MetricsRecorder, cfg: ToyConfig, wall_s: float, dropped: int = 0) -> RingResult:
    steps = rec.rows("step")
    rewards = [r["reward"] for r in steps]
    k = max(1, len(rewards) // 10)
    stale = [s for r in steps for s in r["staleness"]]
    return RingResult(
        backend=cfg.backend,
        steps=len(steps),
        wall_s=round(wall_s, 3),
        steps_per_s=round(len(steps) / wall_s, 2) if wall_s > 0 else 0.0,
        optimum=cfg.optimum,
        random_reward=cfg.random_reward,
        first_reward=round(statistics.fmean(rewards[:k]), 4) if rewards else math.nan,
        last_reward=round(statistics.fmean(rewards[-k:]), 4) if rewards else math.nan,
        expected_reward_final=round(steps[-1]["expected_reward"], 4) if steps else math.nan,
        staleness_mean=round(statistics.fmean(stale), 3) if stale else math.nan,
        staleness_max=max(stale, default=0),
        dropped=dropped,
        run_dir=str(rec.run_dir) if rec.run_dir else None,
    )


async def _stop_all(meshes: list[Any], timeout_s: float) -> None:
    """Stop actor meshes then proc meshes; a shutdown that hangs must not hang the caller."""
    for mesh in meshes:
        try:
            await asyncio.wait_for(asyncio.ensure_future(_awaitable(mesh.stop())), timeout_s)
        except (TimeoutError, Exception) as err:  # keep stopping the others
            print(f"warning: stopping {mesh!r} failed: {err!r}", file=sys.stderr)


async def _awaitable(fut: Any) -> Any:
    return await fut


async def run_ring(
    cfg: ToyConfig,
    recorder: MetricsRecorder | None = None,
    on_step: Callable[[MetricsRecorder], None] | None = None,
    *,
    stop_timeout_s: float = 10.0,
) -> RingResult:
    """Spawn the ring, train ``cfg.steps`` steps, shut it down cleanly; return a summary.

    ``on_step(recorder)`` is called on the controller after every logged step (live plots,
    progress bars). Cancelling this coroutine (or a KeyboardInterrupt) stops every actor and
    runs their ``__cleanup__`` before the exception propagates.
    """
    from grpo_nb.actors import backend  # Monarch is imported only when asked for
    from grpo_nb.toy_actors import actor_classes

    api = backend(cfg.backend)
    ring = actor_classes(api)
    rec = recorder if recorder is not None else MetricsRecorder(None)
    offset = rec.now() - time.time()  # actors stamp wall-clock time; rows use recorder time
    t0 = time.perf_counter()
    meshes: list[Any] = []
    dropped = 0
    try:
        host = api.this_host()
        procs = {"gen": host.spawn_procs(per_host={"gpus": cfg.generators})}
        if cfg.layout == "per_role":
            procs.update({role: host.spawn_procs(per_host={"gpus": 1}) for role in ("scorer", "ref", "trainer")})
        else:
            procs["scorer"] = procs["ref"] = procs["trainer"] = host.spawn_procs(per_host={"gpus": 1})
        metrics, inbox = api.Channel.open()
        trainer = procs["trainer"].spawn("trainer", ring.Trainer, cfg, metrics)
        meshes.append(trainer)
        weights = await trainer.snapshot.call_one()
        scorer = procs["scorer"].spawn("scorer", ring.Scorer, cfg, metrics)
        reference = procs["ref"].spawn("reference", ring.Reference, cfg, weights, metrics)
        meshes += [scorer, reference]
        gens = procs["gen"].spawn("generators", ring.Generator, cfg, weights, await scorer.inlet.call_one(), metrics)
        meshes.insert(0, gens)
        meshes += list({id(p): p for p in procs.values()}.values())
        await trainer.start.call_one(gens)
        await reference.start.call_one(await trainer.inlet.call_one())
        await scorer.start.call_one(await reference.inlet.call_one())
        await gens.start.call()
        t0 = time.perf_counter()
        waiting = {"scorer", "reference", "trainer"}
        while waiting:
            event = await inbox.recv()
            if event.kind == "step":
                rec.log("step", **event.data)
                if on_step is not None:
                    on_step(rec)
            elif event.kind == "busy":
                for actor, label, start, end in event.data:
                    rec.log("busy", t=end + offset, actor=actor, label=label, start=start + offset, end=end + offset)
            elif event.kind == "exited":
                waiting.discard(event.data["actor"])
                dropped += event.data.get("dropped", 0)
            elif event.kind == "error":
                raise RuntimeError(f"toy ring actor {event.data['actor']} failed:\n{event.data['traceback']}")
        wall = time.perf_counter() - t0
    finally:
        await _stop_all(meshes, stop_timeout_s)
    return summarize(rec, cfg, wall, dropped)


def unique_run_name(prefix: str) -> str:
    """``prefix-YYYYmmdd-HHMMSS-pid``: two runs at once (a notebook and a test) never share a file."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def cli(argv: list[str]) -> int:
    """``python -m grpo_nb toy``: run the ring with a progress bar, write metrics + PNG."""
    parser = argparse.ArgumentParser(prog="python -m grpo_nb toy", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="trainer steps (default: the preset's)")
    parser.add_argument("--generators", type=int, help="number of generator actors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["asyncio", "monarch"], default="asyncio")
    parser.add_argument("--kl-coef", type=float, help="KL coefficient")
    parser.add_argument("--smoke", action="store_true", help="the small CI preset (also GRPO_NB_SMOKE=1)")
    parser.add_argument("--name", help="run folder name under runs/ (default: toy-<backend>-<time>)")
    args = parser.parse_args(argv)

    cfg = ToyConfig.smoke() if (args.smoke or smoke_mode()) else ToyConfig()
    overrides = {"steps": args.steps, "generators": args.generators, "kl_coef": args.kl_coef}
    cfg = replace(cfg, seed=args.seed, backend=args.backend, **{k: v for k, v in overrides.items() if v is not None})
    if cfg.backend == "monarch":
        from grpo_nb.actors import MONARCH_MISSING, monarch_available

        if not monarch_available():
            print(MONARCH_MISSING, file=sys.stderr)
            return 2

    from tqdm.auto import tqdm

    from grpo_nb.live import save_figure

    name = args.name or unique_run_name(f"toy-{cfg.backend}")
    rec = MetricsRecorder.for_run(name)
    (rec.run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    bar = tqdm(total=cfg.steps, desc=f"toy ring ({cfg.backend})", unit="step", file=sys.stderr)

    def progress(r: MetricsRecorder) -> None:
        row = r.rows("step")[-1]
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward']:.2f}", kl=f"{row['kl']:.3f}", refresh=False)

    try:
        result = asyncio.run(run_ring(cfg, rec, progress))
    finally:
        bar.close()
        rec.close()
    png = save_figure(rec, rec.run_dir / "toy.png", optimum=cfg.optimum, random_reward=cfg.random_reward)
    result.extra["png"] = str(png)
    print(json.dumps(asdict(result)))
    return 0
