"""The LLM GRPO ring: the toy ring's four stages driving a Qwen model served by vLLM.

The stages are :mod:`grpo_nb.ring`'s skeleton with the LLM's work filled in; each hop carries
one message type, :class:`grpo_nb.serving.rollouts.Group`::

    Generator × K ──Group──► Scorer ──+rewards, advantages──► Reference ──+ref logp──► Trainer
      │ (Source)                (Relay)                        (Relay; passes       │ (Sink)
      │ ≤ max_inflight sequences in flight each,                through when        │ staleness
      │ /v1/completions with token ids + logprobs               kl_coef == 0)       │ admission
      ▲                                                                             ▼
      └──── progress(version, issued) to all ◄── WeightSyncer.sync(v) ◄── PolicyTrainer.step
    every stage ──Event("step" | "sync" | "eval" | "dropped" | "busy" | "exited" | "error")──►
    controller (grpo_nb.llm.run)

Flow control is by *credits*: the trainer says how many groups it wants issued in total, and
generator ``r`` of ``K`` makes its share of them. ``mode="async"`` keeps ``1 + max_ahead``
steps' worth outstanding, so generation overlaps training; ``mode="sync"`` issues one step's
worth only after the weights of the previous step reached the server, so the two alternate.
Nothing else differs between the modes. The trainer drops a group older than
``max_staleness`` versions (counted) and issues a new credit in its place.

The Trainer is in :mod:`grpo_nb.llm.learner`. Shutdown is the skeleton's: the trainer drains the generators (each sends ``None``), the
scorer and reference forward one ``None``, the trainer discards what is still queued.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import torch

from grpo_nb import grpo, tasks
from grpo_nb.actors import current_rank, endpoint
from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Prompt, RingSpec
from grpo_nb.llm.learner import Trainer  # the consuming end, in a module of its own
from grpo_nb.llm.trainer import make_batch, sequence_logprobs
from grpo_nb.ring import Relay, RingError, Source
from grpo_nb.serving.client import ClientConfig, CompletionError, CompletionsClient
from grpo_nb.serving.rollouts import Group, Rollout
from grpo_nb.weight_sync.client import policy_salt

__all__ = ["Generator", "Reference", "RingSpec", "Scorer", "Trainer", "share"]


def share(total: int, rank: int, k: int) -> int:
    """Generator ``rank``'s share of ``total`` groups split as evenly as possible over ``k``."""
    return total // k + (1 if rank < total % k else 0)


def sampling_request(cfg: LLMConfig, version: int) -> dict[str, Any]:
    """One group's request options: ``n = group_size`` samples (the server shares the
    prompt's prefill), salted with the policy version so that no prompt KV of other weights
    is reused (:func:`grpo_nb.weight_sync.policy_salt`). The trainer's log-probs are the full
    softmax at ``cfg.temperature``, so nothing truncates the sampler's: ``top_p`` 1 here, and
    the client sends every other sampling field at its neutral value
    (:func:`grpo_nb.serving.client.sampling_fields`)."""
    return {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "top_p": 1.0,
            "n": cfg.group_size, "cache_salt": policy_salt(version)}


class Generator(Source):
    """Samples groups from the vLLM server, as many as the trainer's credits allow.

    Only complete groups leave it: a group with a sample cut short by a sync
    (``pause_mode="abort"``) or a request that failed (a 4xx such as a prompt over the
    context length, a 5xx, a timeout) is dropped, counted (``"aborted"`` /
    ``"request_failed"`` rows) and sampled again; more than ``error_budget`` failed requests
    end the run with the last one's message.
    """

    quiet_cancel = True  # cancelled mid-request at drain: the HTTP client may complain

    def __init__(self, cfg: LLMConfig, spec: RingSpec, out: Any, metrics: Any) -> None:
        self.cfg, self.spec, self.out = cfg, spec, out
        self.rank = current_rank().rank
        self.attach(metrics, f"gen{self.rank}")
        self.rng = random.Random(cfg.seed * 1009 + self.rank)
        self.version = self.allowed = self.made = 0
        self.failed = self.aborted = 0  # requests that failed / groups cut short by a sync
        self.changed = asyncio.Event()

    @endpoint
    async def start(self) -> None:
        self.launch(self._produce())

    @endpoint
    async def progress(self, version: int, issued: int) -> None:
        """The trainer's weight version, and how many groups the ring may have issued."""
        self.version = version
        self.allowed = share(issued, self.rank, self.cfg.generators)
        self.changed.set()

    async def _produce(self) -> None:
        slots = max(1, self.cfg.max_inflight // self.cfg.group_size)
        client = CompletionsClient(self.spec.server_url + "/v1", self.spec.model_name,
                                   ClientConfig(max_in_flight=slots, timeout_s=60.0, retries=2),
                                   api_key=self.spec.api_key)
        running: set[asyncio.Task] = set()
        try:
            while True:
                while self.made >= self.allowed or len(running) >= slots:
                    self.changed.clear()
                    waiter = asyncio.ensure_future(self.changed.wait())
                    try:
                        done, _ = await asyncio.wait([waiter, *running],
                                                     return_when=asyncio.FIRST_COMPLETED)
                    finally:  # also when cancelled: no pending task left behind
                        waiter.cancel()
                    for t in done & running:
                        running.discard(t)
                        t.result()  # over the error budget: ends the generator (and the run)
                self.made += 1
                running.add(asyncio.create_task(self._one_group(client, self.made)))
        finally:
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await client.close()

    async def _one_group(self, client: CompletionsClient, group_id: int) -> None:
        """Sample one complete group, resubmitting (another prompt) after an abort or a
        failed request; each is counted and reported, never passed on to be scored."""
        while True:
            prompt: Prompt = self.rng.choice(self.spec.prompts)
            version, start = self.version, time.time()
            try:
                # One request with n = group_size: the server shares the prompt's prefill.
                outs = await client.complete(prompt.ids, **sampling_request(self.cfg, version))
            except CompletionError as err:
                self._failed(err, client)
                await asyncio.sleep(0.2)  # a struggling server: do not hammer it
                continue
            if any(o.finish_reason == "abort" for o in outs):
                # Cut short by a sync with pause_mode="abort": a partial sample is not a
                # sample of the policy, and its reward would be wrong. Expected, not a fault.
                self.aborted += 1
                self.report("aborted", actor=self.name, group=group_id, total=self.aborted)
                continue
            break
        rollouts = [Rollout(list(prompt.ids), o.token_ids, o.logprobs, o.text, o.finish_reason,
                            policy_version=version, group_id=group_id, latency_s=o.latency_s)
                    for o in outs]
        self.out.send(Group(group_id, prompt.text, prompt.answer, list(prompt.ids), rollouts,
                            version, t_submit=start, t_done=time.time(), source=self.name))
        self.busy.add("generate", start)

    def _failed(self, err: CompletionError, client: CompletionsClient) -> None:
        """Count a failed request; past ``error_budget`` of them the generator gives up."""
        self.failed += 1
        self.report("request_failed", actor=self.name, total=self.failed, status=err.status,
                    error=str(err)[:300])
        if self.failed > self.cfg.error_budget:
            raise RingError(
                f"{self.name}: {self.failed} failed requests (> LLMConfig.error_budget="
                f"{self.cfg.error_budget}); last: {err} [client counts: "
                f"4xx={client.stats.http_4xx} 5xx={client.stats.http_5xx} "
                f"timeouts={client.stats.timeouts} "
                f"connection={client.stats.connection_errors}]") from err


class Scorer(Relay):
    """Rewards every completion with ``cfg.reward``, then turns a group's rewards into
    advantages. ``"auto"`` is the task's answer check (``spec.reward_default``)."""

    name = "scorer"
    sender = "the generators"
    label = "score"

    def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any) -> None:
        self.cfg = cfg
        self.upstream = cfg.generators  # each generator ends with one None
        self.reward = tasks.make_reward(cfg.reward, default=spec.reward_default)
        self.attach(metrics)
        self.open_inlet()

    async def process(self, group: Group) -> Group:
        for r in group.rollouts:
            # The answer *then* end-of-sequence: a completion cut at max_tokens scores 0.
            r.reward = (float(self.reward(r.completion_text, group.answer))
                        if r.finish_reason == "stop" else 0.0)
        adv = grpo.group_advantages(torch.tensor(group.rewards), self.cfg.group_size)
        for r, a in zip(group.rollouts, adv.tolist(), strict=True):
            r.advantage = a
        return group


class Reference(Relay):
    """Adds the frozen base model's log-probs of each completion (for the KL penalty)."""

    name = "reference"
    sender = "scorer"

    def __init__(self, cfg: LLMConfig, spec: RingSpec, metrics: Any) -> None:
        self.cfg = cfg
        self.attach(metrics)
        self.open_inlet()
        self.model = None
        if cfg.kl_coef > 0:  # the reference model costs memory and time: only if used
            from grpo_nb.llm import placement
            from grpo_nb.llm.trainer import load_policy

            self.model, _ = load_policy(spec.model_dir, placement.trainer_device(cfg),
                                        placement.dtype_of(cfg), trainable=False)
        self.label = "ref logp" if self.model is not None else "pass through"

    async def process(self, group: Group) -> Group:
        if self.model is not None:
            per_rollout = await asyncio.to_thread(self._ref_logprobs, group)
            for r, lp in zip(group.rollouts, per_rollout, strict=True):
                r.ref_logprobs = lp
        return group

    def _ref_logprobs(self, group: Group) -> list[list[float]]:
        b = make_batch([group], pad_id=0)
        dev = next(self.model.parameters()).device
        with torch.no_grad():
            lp = sequence_logprobs(self.model, b.input_ids.to(dev), b.attention_mask.to(dev),
                                   self.cfg.temperature).float().cpu()
        p = len(group.prompt_ids)
        return [lp[i, p - 1:p - 1 + len(r.completion_ids)].tolist()
                for i, r in enumerate(group.rollouts)]
