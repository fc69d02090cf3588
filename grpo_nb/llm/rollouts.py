"""Sampling a group from the vLLM server, the one way the ring, notebook 04 and ``python -m
grpo_nb rollouts`` do it (one ``/inference/v1/generate`` request with ``n = group_size``: each
token comes with the weight version that sampled it); scoring it (rewards, the overlong
handling, then the group's advantages); per-token version lag; held-out evaluation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_nb import grpo
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, Prompt, Rollout
from grpo_nb.serving.client import Completion, CompletionsClient, policy_salt

# fp32 on both sides: vLLM's and transformers' kernels agree far inside this (measured ≈ 1e-5;
# on CUDA the server's attention is IEEE fp32 too: ServerConfig.environment).
LOGPROB_TOLERANCE = 1e-4
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significant bits: a rounding is off by <= 2^-8 relative
LOGIT_MAX = 32.0  # |logit| bound the bf16 tolerance assumes (a trained LM's top logits: ≈ 20-30)
ROUNDINGS = 4  # bf16 logit error, in roundings of |logit|: measured <= 3 (tests/test_rollouts.py)
VLLM_GREEDY_BELOW = 1e-5  # vllm/v1/sample/sampler.py's _SAMPLING_EPS


def logprob_tolerance(dtype: str, temperature: float = 1.0) -> float:
    """The largest ``|server − fp32 model|`` log-prob gap a run served in ``dtype`` may show.

    fp32: :data:`LOGPROB_TOLERANCE`. bf16: ``log p_i = z_i/T − logsumexp(z/T)`` moves by
    ``(δz_i − Σ_j p_j δz_j) / T``, so ``|δ log p| <= 2 max|δz| / T``; a bf16 logit carries
    ``|δz| <= ROUNDINGS · 2^-8 · |z|`` (its own rounding plus those of the hidden state it is
    made from), so with ``|z| <= LOGIT_MAX`` the gap is at most ``2 · 4 · 2^-8 · 32 / T = 1/T``."""
    if dtype == "float32":
        return LOGPROB_TOLERANCE
    if dtype != "bfloat16":
        raise ValueError(f"dtype={dtype!r}: a log-prob tolerance is known for 'float32' and "
                         "'bfloat16'")
    t = temperature if temperature >= VLLM_GREEDY_BELOW else 1.0
    return 2 * ROUNDINGS * BF16_UNIT_ROUNDOFF * LOGIT_MAX / t


def sampling_request(cfg: LLMConfig, version: int, seed: int | None = None) -> dict[str, Any]:
    """One group's request: ``top_p`` 1, as the trainer's log-probs are the full softmax, and
    salted so that vLLM never reuses prompt KV that other weights computed."""
    return {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "top_p": 1.0,
            "n": cfg.group_size, "cache_salt": policy_salt(version),
            **({} if seed is None else {"seed": seed})}


def token_versions(labels: Sequence[str] | None, n_tokens: int, fallback: int) -> list[int]:
    """Each token's weight version from the server's labels (``/update_weight_version`` sets
    them); ``fallback`` (the version at submit) for a label that is not an integer (vLLM's
    ``"default"`` before any sync) or for every token when the server sent none."""
    if labels is None:
        return [fallback] * n_tokens
    return [int(x) if x.lstrip("-").isdigit() else fallback for x in labels]


async def generate(client: CompletionsClient, prompt_ids: Sequence[int], params: dict[str, Any],
                   *, kv: str = "keep", version: Callable[[], int] = lambda: 0
                   ) -> list[Completion]:
    """:meth:`CompletionsClient.generate` with its ``params``. ``kv="recompute"``
    (``WeightSyncConfig.kv``): each choice a sync aborted is continued, once per sync, from prompt
    + its tokens, salted for ``version()`` then; vLLM queues it until the sync's ``/resume``, so
    every token after the sync is computed over KV the new weights made. ``"keep"``: the choices
    as the server ended them."""
    outs = await client.generate(list(prompt_ids), **params)
    if kv != "recompute":
        return outs
    return list(await asyncio.gather(*(_resumed(client, list(prompt_ids), o, params, version, k)
                                       for k, o in enumerate(outs))))


async def _resumed(client: CompletionsClient, prompt_ids: list[int], out: Completion,
                   params: dict[str, Any], version: Callable[[], int], k: int) -> Completion:
    """``out`` (choice ``k``) continued until it ends other than by an abort."""
    budget = int(params.get("max_tokens", 16))  # CompletionsClient.generate's default
    v = version()
    while out.finish_reason == "abort" and len(out.token_ids) < budget:
        w = version()
        more_params = {**params, "n": 1, "max_tokens": budget - len(out.token_ids),
                       "cache_salt": policy_salt(w)}
        if params.get("seed") is not None:  # a sample of its own, reproducible
            more_params["seed"] = params["seed"] + 1 + k + len(out.token_ids)
        (more,) = await client.generate(prompt_ids + out.token_ids, **more_params)
        out = Completion(out.token_ids + more.token_ids, out.logprobs + more.logprobs,
                         out.text + more.text, more.finish_reason, out.latency_s + more.latency_s,
                         _labels(out, v) + _labels(more, w))
        v = w
    if out.finish_reason == "abort":  # cut at its last token: what it would have ended as
        out.finish_reason = "length"
    return out


def _labels(out: Completion, version: int) -> list[str]:
    return out.versions if out.versions is not None else [str(version)] * len(out.token_ids)


async def sample_group(client: CompletionsClient, prompt: Prompt, cfg: LLMConfig,
                       version: Callable[[], int] = lambda: 0, *, group_id: int = 0,
                       source: str = "", seed: int | None = None,
                       on_abort: Callable[[], None] | None = None) -> Group:
    """``cfg.group_size`` completions of ``prompt``, unscored, each token with the weight
    version that sampled it (a sync during the request splits a completion between two);
    ``version()`` is the trainer's version at submit (the cache salt). With ``cfg.sync.kv``
    ``"recompute"`` a completion cut by a sync is resubmitted (:func:`generate`); else a group the
    server aborted (``pause_mode="abort"``) is incomplete: it is sampled again (``on_abort``)."""
    while True:
        v, start = version(), time.time()
        outs = await generate(client, prompt.ids, sampling_request(cfg, v, seed),
                              kv=cfg.sync.kv, version=version)
        if not any(o.finish_reason == "abort" for o in outs):
            break
        if on_abort is not None:
            on_abort()
    rollouts = [Rollout(o.token_ids, o.logprobs, o.text, o.finish_reason, latency_s=o.latency_s,
                        token_versions=token_versions(o.versions, len(o.token_ids), v))
                for o in outs]
    oldest = min((min(r.token_versions, default=v) for r in rollouts), default=v)
    return Group(group_id, prompt.text, prompt.answer, list(prompt.ids), rollouts, oldest,
                 t_submit=start, t_done=time.time(), source=source)


def score_group(group: Group, reward: Callable[[str, str], float], cfg: LLMConfig) -> Group:
    """Set each rollout's reward, then :func:`finish_scoring`; a completion cut at
    ``max_tokens`` (not ``"stop"``) scores 0: the answer must be followed by end-of-sequence."""
    for r in group.rollouts:
        r.reward = float(reward(r.completion_text, group.answer)) \
            if r.finish_reason == "stop" else 0.0
    return finish_scoring(group, cfg)


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of a ``length``-token completion,
    with ``L_max = max_tokens`` and ``L_cache = buffer``: 0 while ``length <= L_max - L_cache``,
    then ``(L_max - L_cache - length) / L_cache`` (-1 at ``L_max``), and -1 beyond ``L_max``."""
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return (start - length) / buffer if length <= max_tokens else -1.0


def finish_scoring(group: Group, cfg: LLMConfig) -> Group:
    """``cfg.overlong`` on a group whose rewards are set, then its advantages: ``"filter"`` marks
    each truncated completion (``finish_reason == "length"``) ``masked``, out of the loss;
    ``"soft"`` adds :func:`overlong_penalty` of its length to every reward; ``"zero"`` neither."""
    for r in group.rollouts:
        r.masked = cfg.overlong == "filter" and r.finish_reason == "length"
        if cfg.overlong == "soft":
            r.reward += overlong_penalty(len(r.completion_ids), cfg.max_tokens,
                                         cfg.overlong_buffer)
    adv = grpo.group_advantages(torch.tensor(group.rewards), len(group.rollouts),
                                scale=cfg.adv_scale)
    for r, a in zip(group.rollouts, adv.tolist(), strict=True):
        r.advantage = a
    return group


async def sample_groups(client: CompletionsClient, prompts: Sequence[Prompt], cfg: LLMConfig,
                        *, reward: Callable[[str, str], float] | None = None,
                        seed: int | None = None) -> list[Group]:
    """A group per prompt, all in flight at once, in order; scored when ``reward`` is given."""
    tasks = [asyncio.ensure_future(sample_group(
        client, p, cfg, group_id=i, seed=None if seed is None else seed + i * cfg.group_size))
        for i, p in enumerate(prompts)]
    try:
        groups = await asyncio.gather(*tasks)
    finally:  # one failed group: cancel (and wait for) the others, never leave them running
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return groups if reward is None else [score_group(g, reward, cfg) for g in groups]


def flatten(groups: Sequence[Group]) -> list[Rollout]:
    return [r for g in groups for r in g.rollouts]


def token_lags(groups: Sequence[Group], trainer_version: int) -> dict[str, Any]:
    """The lag of every completion token the trainer at ``trainer_version`` updates on
    (``trainer_version`` − the version that sampled it): mean, max, the number of tokens at
    each lag 0, 1, … (``token_lag_counts``), and the fraction of completions whose tokens
    span more than one version."""
    rollouts = flatten(groups)
    lags = [trainer_version - v for r in rollouts for v in r.token_versions]
    return {"token_lag_mean": sum(lags) / len(lags) if lags else 0.0,
            "token_lag_max": max(lags, default=0),
            "token_lag_counts": [lags.count(k) for k in range(max(lags, default=-1) + 1)],
            "mixed_version_frac": sum(len(set(r.token_versions)) > 1 for r in rollouts)
            / max(len(rollouts), 1)}


def logprob_agreement(model: Any, groups: Sequence[Group], *, temperature: float,
                      dtype: str = "float32") -> dict[str, float]:
    """vLLM's sampler log-probs against ``model``'s, token by token, for groups sampled at
    ``temperature``: the server returns processed log-probs (``log_softmax(logits / T)``, see
    :mod:`grpo_nb.serving.server`), so ``model``'s are taken at the same ``T``; below
    ``VLLM_GREEDY_BELOW`` vLLM samples greedily and returns them at temperature 1. The
    tolerance is :func:`logprob_tolerance` of the server's ``dtype``."""
    from grpo_nb.llm.policy import completion_logprobs

    rollouts = flatten(groups)
    if not rollouts:
        raise ValueError("no rollouts to compare")
    t = temperature if temperature >= VLLM_GREEDY_BELOW else 1.0
    diffs = torch.cat([(mine - torch.tensor(r.sampler_logprobs)).abs() for mine, r in
                       zip(completion_logprobs(model, groups, t), rollouts, strict=True)])
    return {"max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
            "tokens": int(diffs.numel()), "tolerance": logprob_tolerance(dtype, t)}


def summarize(groups: Sequence[Group], seconds: float) -> dict[str, Any]:
    """Accuracy (mean correctness of samples), tokens/s, groups and mixed-reward groups."""
    rollouts = flatten(groups)
    tokens = sum(len(r.completion_ids) for r in rollouts)
    return {"groups": len(groups), "samples": len(rollouts),
            "accuracy": sum(r.reward >= 1.0 for r in rollouts) / max(1, len(rollouts)),
            "mixed_groups": sum(len(set(g.rewards)) > 1 for g in groups), "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


@dataclass
class EvalResult:
    accuracy: float  # greedy, on the held-out prompts
    n: int
    truncated: int  # completions that hit max_tokens (scored wrong)


async def greedy_accuracy(client: CompletionsClient, prompts: Sequence[Prompt],
                          checker: Callable[[str, str], float], max_tokens: int, *,
                          batch: int = 64, cache_salt: str | None = None) -> EvalResult:
    """Held-out accuracy of greedy samples (``batch`` prompts a request, the requests side by
    side), a truncated one wrong."""
    if not prompts:
        return EvalResult(float("nan"), 0, 0)

    async def chunk(part: Sequence[Prompt]) -> list[Completion]:
        outs = await client.complete([list(p.ids) for p in part], max_tokens=max_tokens,
                                     temperature=0.0, cache_salt=cache_salt)
        if len(outs) != len(part):
            raise RuntimeError(f"evaluation: {len(part)} prompts, {len(outs)} completions")
        return outs

    parts = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    outs = [o for part in await asyncio.gather(*(chunk(p) for p in parts)) for o in part]
    correct = truncated = 0
    for prompt, out in zip(prompts, outs, strict=True):
        truncated += out.finish_reason == "length"
        correct += out.finish_reason == "stop" and checker(out.text, prompt.answer) >= 1.0
    return EvalResult(correct / len(prompts), len(prompts), truncated)
