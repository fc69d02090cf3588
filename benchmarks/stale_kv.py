"""The stale KV cache, measured: what a weight sync does to the completions it cuts.

    tiny model W0 on a vLLM server ─► long completions decoding ─► sync W1 mid-flight
        kv="keep":      they go on over the KV W0 computed (W1 attending to stale keys/values)
        kv="recompute": the sync aborts them, the sampler resubmits prompt + their tokens
                        (grpo_nb.llm.rollouts.generate): every later token over W1's own KV
    ─► per token: |sampler log-prob − trainer log-prob under the weights that produced it|
       (the token's version label: W0 before the sync, W1 after), mean over the tokens after
       the sync of the completions the sync cut, against the same on completions no sync
       touched (the numerical floor: fp32 vLLM vs fp32 transformers)

W1 is W0 after ``--updates`` Adam steps at each ``--lr`` on next-token loss of random token
sequences (a bigger learning rate: a bigger weight change, a bigger stale-KV effect). One JSON
line: per learning rate ``keep_gap`` / ``recompute_gap`` / ``floor_gap`` and their ratios to
the floor, measured in one run on one server.

Run: ``.venv/bin/python benchmarks/stale_kv.py [--lr 3e-4 3e-3 3e-2] [--completions 8]
[--max-tokens 160]``. The server start dominates the runtime (≈ 1–4 min on 2 cores).

From Python (a notebook with its own server, started with ``grpo_nb.llm.run.server_for``):
``sys.path.insert(0, "<repo>/benchmarks"); import stale_kv; stale_kv.measure(server, model_dir,
lrs=(3e-2,), completions=4, max_tokens=96)`` returns the same dict; it leaves the server
serving ``model_dir``'s own weights.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

FIRST_VERSION = 1000  # the labels this measurement syncs under: apart from a caller's own


def bumped(model: torch.nn.Module, lr: float, updates: int, seed: int) -> torch.nn.Module:
    """A copy of ``model`` after ``updates`` Adam steps at ``lr`` on next-token loss of random
    token sequences: a weight change of the size a training step at that rate makes."""
    from grpo_nb import grpo

    new = copy.deepcopy(model)
    new.train()
    opt = torch.optim.Adam(new.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(updates):
        ids = torch.randint(0, int(new.config.vocab_size), (8, 32), generator=gen)
        loss = -grpo.sequence_logprobs(new, ids, torch.ones_like(ids), 1.0).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    new.eval()
    return new


def _change(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """‖b − a‖ / ‖a‖ over every parameter."""
    num = sum(float((pb - pa).detach().double().pow(2).sum()) for pa, pb in
              zip(a.parameters(), b.parameters(), strict=True))
    den = sum(float(pa.detach().double().pow(2).sum()) for pa in a.parameters())
    return (num / den) ** 0.5


def gaps(outs: Sequence[Any], prompts: Sequence[list[int]], models: dict[int, torch.nn.Module],
         temperature: float) -> list[list[tuple[int, float]]]:
    """Per completion, each token's (version, |sampler − trainer log-prob|), the trainer's under
    ``models[version]`` (the weights that produced it), on prompt + every token before it."""
    from grpo_nb.llm.data import Group, Rollout
    from grpo_nb.llm.policy import completion_logprobs
    from grpo_nb.llm.rollouts import token_versions

    groups = [Group(i, "", "", list(p), [Rollout(o.token_ids, o.logprobs, o.text,
                                                 o.finish_reason)], 0, 0.0, 0.0)
              for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    versions = [token_versions(o.versions, len(o.token_ids), -1) for o in outs]
    mine = {v: completion_logprobs(m, groups, temperature) for v, m in models.items()}
    return [[(v, abs(float(mine[v][i][j]) - o.logprobs[j])) if v in mine else (v, float("nan"))
             for j, v in enumerate(versions[i])] for i, o in enumerate(outs)]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _cut(per_token: list[list[tuple[int, float]]], new: int) -> dict[str, Any]:
    """The tokens labelled ``new`` of the completions whose tokens span two versions."""
    cut = [c for c in per_token if len({v for v, _ in c}) > 1]
    after = [g for c in cut for v, g in c if v == new]
    return {"gap": _mean(after), "max": max(after, default=None), "tokens": len(after),
            "cut": len(cut), "completions": len(per_token)}


async def _sample(server: Any, prompts: Sequence[list[int]], params: dict[str, Any], kv: str,
                  version: Any, calls: list[list[int]]) -> list[Any]:
    from grpo_nb.llm.rollouts import generate
    from grpo_nb.serving.client import CompletionsClient

    async with CompletionsClient.for_server(server) as client:
        real = client.generate

        async def counted(prompt_ids: list[int], **kw: Any) -> list[Any]:
            calls.append(list(prompt_ids))
            return await real(prompt_ids, **kw)

        client.generate = counted  # type: ignore[method-assign]
        return [o for outs in await asyncio.gather(*(
            generate(client, p, params, kv=kv, version=version) for p in prompts)) for o in outs]


def cut_by_a_sync(server: Any, prompts: Sequence[list[int]], params: dict[str, Any],
                  syncer: Any, new_version: int, after_tokens: int = 8
                  ) -> tuple[list[Any], list[list[int]], float]:
    """Sample ``prompts`` (one choice each) with ``syncer.cfg.kv`` while ``syncer`` syncs its
    model as ``new_version`` once the first has made about ``after_tokens`` tokens. Returns the
    completions, every request's token ids as sent, and the sync's milliseconds."""
    from grpo_nb.serving.control import VLLMControlClient

    control = VLLMControlClient(server.url, api_key=server.api_key)
    current, done = [new_version - 1], {}

    def sync() -> None:
        try:
            if not control.wait_running(1, timeout=300):
                raise TimeoutError("no request started decoding within 300 s")
            time.sleep(after_tokens * 0.01)
            done["ms"] = syncer.sync(new_version, verify=False).ms
            current[0] = new_version
        except BaseException as err:  # handed to the caller
            done["error"] = err

    calls: list[list[int]] = []
    thread = threading.Thread(target=sync, daemon=True)
    thread.start()
    outs = asyncio.run(_sample(server, prompts, params, syncer.cfg.kv, lambda: current[0], calls))
    thread.join(300)
    if "error" in done:
        raise done["error"]
    return outs, calls, done.get("ms", float("nan"))


def measure(server: Any, model_dir: str, *, lrs: Sequence[float] = (3e-4, 3e-3, 3e-2),
            updates: int = 1, completions: int = 8, max_tokens: int = 160,
            temperature: float = 1.0, pause_mode: str = "none", seed: int = 0) -> dict[str, Any]:
    """Per learning rate: the stale-KV gap with ``kv="keep"`` and ``"recompute"``, and the floor
    (module docstring). ``server``: started with the ring's settings (weight sync, scale-out)."""
    from grpo_nb.llm.policy import load_policy
    from grpo_nb.llm.rollouts import logprob_tolerance
    from grpo_nb.weight_sync import WeightSyncConfig, WeightSyncer

    base, tok = load_policy(model_dir)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(base.config.vocab_size)
    prompts = [torch.randint(3, vocab, (8,), generator=gen).tolist() for _ in range(completions)]
    params = {"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True,
              "seed": seed}
    served = copy.deepcopy(base)  # what the syncers send: W0 or W1, copied in before each sync
    version, runs = FIRST_VERSION, []
    for lr in lrs:
        new = bumped(base, lr, updates, seed)
        run: dict[str, Any] = {"lr": lr, "weight_change_rel": _change(base, new)}
        for kv in ("keep", "recompute"):
            cfg = WeightSyncConfig(pause_mode=pause_mode, kv=kv, verify=False)
            with WeightSyncer(server.url, served, cfg, api_key=server.api_key) as syncer:
                served.load_state_dict(base.state_dict())
                syncer.sync(version)  # W0, nothing in flight
                old = version
                served.load_state_dict(new.state_dict())
                version += 1
                outs, calls, ms = cut_by_a_sync(server, prompts, params, syncer, version)
                per_token = gaps(outs, prompts, {old: base, version: new}, temperature)
                cut = _cut(per_token, version)
                run[f"{kv}_gap"], run[f"{kv}_max"] = cut["gap"], cut["max"]
                run[f"{kv}_tokens"], run[f"{kv}_cut"] = cut["tokens"], cut["cut"]
                run[f"{kv}_requests"], run[f"{kv}_sync_ms"] = len(calls), round(ms, 1)
                if kv == "keep":  # the floor: the same prompts under W1 alone, no sync meanwhile
                    again = asyncio.run(_sample(server, prompts, params, kv,
                                                lambda v=version: v, []))
                    floor = [g for c in gaps(again, prompts, {version: new}, temperature)
                             for _, g in c]
            version += 1
        run["floor_gap"], run["floor_max"], run["floor_tokens"] = _mean(floor), max(floor), \
            len(floor)
        for kv in ("keep", "recompute"):
            gap = run[f"{kv}_gap"]
            run[f"{kv}_ratio"] = None if gap is None else gap / run["floor_gap"]
        runs.append(run)
    with WeightSyncer(server.url, base, WeightSyncConfig(pause_mode=pause_mode, verify=False),
                      api_key=server.api_key) as syncer:
        syncer.sync(version)  # the server serves model_dir's own weights again
    del tok
    return {"benchmark": "stale_kv", "runs": runs,
            "tolerance": logprob_tolerance("float32", temperature),
            "settings": {"model": str(model_dir), "completions": completions,
                         "max_tokens": max_tokens, "temperature": temperature,
                         "pause_mode": pause_mode, "updates": updates, "lrs": list(lrs),
                         "weight_change": f"W1 = W0 after {updates} Adam step(s) at each lr on "
                         "next-token loss of random tokens; the ring's default lr is 3e-4",
                         "prompts": "8 random token ids each, one completion each, "
                         "ignore_eos"}}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lr", type=float, nargs="+", default=[3e-4, 3e-3, 3e-2])
    p.add_argument("--updates", type=int, default=1)
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--pause-mode", default="none", choices=["none", "keep"])
    args = p.parse_args(argv)
    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.llm.run import server_for
    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    t0, load = time.time(), os.getloadavg()
    model_dir = build_or_load(TinyModelConfig.smoke() if os.environ.get("GRPO_NB_SMOKE")
                              else TinyModelConfig(), progress=False)
    server = server_for(str(model_dir), LLMConfig()).start(progress=False)
    try:
        t1 = time.time()
        result = measure(server, str(model_dir), lrs=args.lr, updates=args.updates,
                         completions=args.completions, max_tokens=args.max_tokens,
                         pause_mode=args.pause_mode)
    finally:
        server.stop()
    result.update(measure_s=round(time.time() - t1, 1), server_start_s=round(t1 - t0, 1),
                  load_avg_before=[round(x, 2) for x in load],
                  load_avg_after=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
