"""Groups of scored completions from a vLLM server: the data GRPO learns from.

For each prompt the generator asks the server for ``group_size`` samples, scores each with the
task's verifiable reward, and turns the rewards into group-relative advantages::

    rows {prompt, answer} ──render_prompt──► prompt ids
          │
          └─► generate_group ──group_size × client.complete()──► vLLM (/v1/completions)
                    │  token ids + sampler log-probs + finish reason + latency
                    ▼
        make_reward(reward)(text, answer) ──► grpo.group_advantages ──► Group[Rollout × group_size]
                    │
     iter_groups / generate_groups: many groups in flight (bounded by the client), yielded as
     they finish ──► logprob_agreement(model, groups): vLLM vs transformers, same tokens

Each sample is its own request (``n=1``), so the client's in-flight bound counts sequences and
a slow sample does not hold a finished one back. A group is only complete with all its samples:
if one fails, the group is dropped *and counted* (``ClientStats.groups_dropped``), or the
error is raised (``on_error="raise"``, the default).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from grpo_nb.grpo import group_advantages, token_logprobs
from grpo_nb.serving.client import CompletionError, CompletionsClient
from grpo_nb.tasks import RewardSpec, make_reward, render_prompt

# fp32 on both sides: vLLM's and transformers' kernels agree to ~1e-5, well inside this.
LOGPROB_TOLERANCE = 1e-4
ABORT_RETRIES = 3  # a group whose samples were aborted is sampled again at most this often


@dataclass
class SamplingConfig:
    """How rollouts are sampled and scored.

    ``temperature`` and ``top_p`` are the only sampling fields a request varies; the client
    sends every other one at vLLM's neutral value
    (:func:`~grpo_nb.serving.client.sampling_fields`), so a model folder's
    ``generation_config.json`` changes nothing. ``reward`` is a :func:`~grpo_nb.tasks.make_reward`
    spec, e.g. ``"math+0.1*format"`` for a format bonus.
    """

    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    reward: RewardSpec = "math"
    adv_scale: Literal["std", "none"] = "std"

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens={self.max_tokens}: must be ≥ 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature}: must be ≥ 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p}: use (0, 1]")
        if self.adv_scale not in ("std", "none"):
            raise ValueError(f"SamplingConfig.adv_scale={self.adv_scale!r}: 'std' or 'none'")
        try:
            make_reward(self.reward)
        except ValueError as err:
            raise ValueError(f"SamplingConfig.reward={self.reward!r}: {err}") from None

    @classmethod
    def smoke(cls) -> SamplingConfig:
        return cls()


@dataclass
class Rollout:
    """One sampled completion with everything the trainer needs.

    ``reward`` and ``advantage`` are filled by whoever scores the group (:func:`generate_group`
    at once; in the LLM ring, its Scorer stage), ``ref_logprobs`` by the ring's Reference stage
    when a KL penalty is used.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float]
    completion_text: str
    finish_reason: str | None
    reward: float = 0.0
    advantage: float = 0.0
    policy_version: int = 0
    group_id: int = 0
    latency_s: float = 0.0
    ref_logprobs: list[float] | None = None


@dataclass
class Group:
    """``group_size`` rollouts of one prompt; advantages are relative to this group.

    This is also the one message of the LLM ring (:mod:`grpo_nb.llm.actors`): generator →
    scorer → reference → trainer. ``policy_version`` is the weight version the server had when
    the requests were sent (a lower bound: with pause mode ``keep`` later tokens may come from
    newer weights); ``source`` names the generator that made it.
    """

    group_id: int
    prompt: str
    answer: str
    prompt_ids: list[int]
    rollouts: list[Rollout]
    policy_version: int
    # Wall clock (time.time()), not perf_counter: the ring compares it across processes.
    t_submit: float  # when the first request was sent
    t_done: float  # … when the last sample arrived
    extra: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    @property
    def advantages(self) -> list[float]:
        return [r.advantage for r in self.rollouts]

    @property
    def seconds(self) -> float:
        return self.t_done - self.t_submit

    @property
    def n_tokens(self) -> int:
        return sum(len(r.completion_ids) for r in self.rollouts)


Version = int | Callable[[], int]


def _version(v: Version) -> int:
    return int(v() if callable(v) else v)


async def generate_group(client: CompletionsClient, row: dict[str, Any], group_size: int, *,
                         prompt_ids: list[int], sampling: SamplingConfig | None = None,
                         policy_version: Version = 0, group_id: int = 0) -> Group:
    """Sample and score one group; raises :class:`CompletionError` if any sample fails."""
    sampling = sampling or SamplingConfig()
    version = _version(policy_version)  # the policy that *starts* serving this group
    t_submit = time.time()

    async def one(i: int):
        seed = None if sampling.seed is None else sampling.seed + group_id * group_size + i
        return (await client.complete(prompt_ids, max_tokens=sampling.max_tokens,
                                      temperature=sampling.temperature, top_p=sampling.top_p,
                                      seed=seed))[0]

    for attempt in range(ABORT_RETRIES + 1):
        tasks = [asyncio.ensure_future(one(i)) for i in range(group_size)]
        try:
            completions = await asyncio.gather(*tasks)
        finally:  # one failed sample: cancel (and wait for) its siblings, never leave them
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if not any(c.finish_reason == "abort" for c in completions):
            break
        # A sample cut short (/pause?mode=abort) is not a finished sample: drop the group
        # (counted) and sample it again, rather than score a truncated completion.
        client.stats.groups_dropped += 1
        if attempt == ABORT_RETRIES:
            raise CompletionError("aborted", f"group {group_id}: samples aborted by the server "
                                  f"{ABORT_RETRIES + 1} times in a row")
    score = make_reward(sampling.reward)
    rewards = [score(c.text, row["answer"]) for c in completions]
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), group_size,
                           scale=sampling.adv_scale).tolist()
    rollouts = [Rollout(prompt_ids=list(prompt_ids), completion_ids=c.token_ids,
                        sampler_logprobs=c.logprobs, completion_text=c.text,
                        finish_reason=c.finish_reason, reward=r, advantage=a,
                        policy_version=version, group_id=group_id, latency_s=c.latency_s)
                for c, r, a in zip(completions, rewards, adv, strict=True)]
    return Group(group_id=group_id, prompt=row["prompt"], answer=row["answer"],
                 prompt_ids=list(prompt_ids), rollouts=rollouts, policy_version=version,
                 t_submit=t_submit, t_done=time.time())


async def iter_groups(client: CompletionsClient, rows: Sequence[dict[str, Any]], group_size: int,
                      *, tokenizer: Any, sampling: SamplingConfig | None = None,
                      policy_version: Version = 0, on_error: Literal["raise", "skip"] = "raise",
                      first_group_id: int = 0) -> AsyncIterator[Group]:
    """Start a group per row (the client bounds in-flight requests) and yield each when done.

    ``on_error="skip"`` drops a failed group and counts it in ``client.stats.groups_dropped``;
    the failure itself is already counted by the client. Leaving the loop early (``break``,
    an exception, cancellation) cancels and awaits every pending group.
    """
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: GRPO needs ≥ 2 samples per prompt")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error={on_error!r}: 'raise' or 'skip'")
    pending = {
        asyncio.ensure_future(generate_group(
            client, row, group_size, prompt_ids=render_prompt(tokenizer, row),
            sampling=sampling, policy_version=policy_version, group_id=first_group_id + i))
        for i, row in enumerate(rows)
    }
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                try:
                    yield task.result()
                except CompletionError:
                    if on_error == "raise":
                        raise
                    client.stats.groups_dropped += 1
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def generate_groups(client: CompletionsClient, rows: Sequence[dict[str, Any]],
                          group_size: int, **kw: Any) -> list[Group]:
    """All groups of :func:`iter_groups`, sorted by ``group_id`` (the order of ``rows``)."""
    groups = [g async for g in iter_groups(client, rows, group_size, **kw)]
    return sorted(groups, key=lambda g: g.group_id)


def flatten(groups: Sequence[Group]) -> list[Rollout]:
    return [r for g in groups for r in g.rollouts]


@torch.no_grad()
def model_logprobs(model: Any, rollouts: Sequence[Rollout], batch_size: int = 64) -> list[Any]:
    """The model's own log-prob of every completion token (temperature 1), one tensor each.

    Sequences are right-padded: in a causal model padding *after* a token cannot change it.
    """
    out: list[Any] = []
    for start in range(0, len(rollouts), batch_size):
        chunk = rollouts[start : start + batch_size]
        seqs = [r.prompt_ids + r.completion_ids for r in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        lp = token_logprobs(logits[:, :-1], ids[:, 1:])
        for i, r in enumerate(chunk):
            p = len(r.prompt_ids)
            out.append(lp[i, p - 1 : p - 1 + len(r.completion_ids)])
    return out


def logprob_agreement(model: Any, groups: Sequence[Group]) -> dict[str, float]:
    """Compare vLLM's sampler log-probs with the transformers model's, token by token.

    Our servers report log-probs *after* temperature and top-p (``--logprobs-mode
    processed_logprobs``, :class:`~grpo_nb.serving.server.ServerConfig`); they are compared
    with the model's temperature-1 log-softmax, so sample at ``temperature=1, top_p=1``.
    """
    rollouts = flatten(groups)
    if not rollouts:
        raise ValueError("no rollouts to compare")
    ours = model_logprobs(model, rollouts)
    diffs = torch.cat([(mine - torch.tensor(r.sampler_logprobs)).abs()
                       for mine, r in zip(ours, rollouts, strict=True)])
    return {"max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
            "tokens": int(diffs.numel()), "tolerance": LOGPROB_TOLERANCE}


def summarize(groups: Sequence[Group], seconds: float) -> dict[str, Any]:
    """Accuracy (mean correctness of samples), tokens/s, groups and mixed-reward groups."""
    rollouts = flatten(groups)
    tokens = sum(len(r.completion_ids) for r in rollouts)
    mixed = sum(len(set(g.rewards)) > 1 for g in groups)
    return {"groups": len(groups), "samples": len(rollouts),
            "accuracy": sum(r.reward >= 1.0 for r in rollouts) / max(1, len(rollouts)),
            "mixed_groups": mixed, "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}

