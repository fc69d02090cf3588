"""Held-out accuracy, measured the way the policy is used: greedy samples from the vLLM server.

::

    held-out Prompt × N ──chunks of `batch` prompts, one /v1/completions each (temperature 0)──►
        server (the weights of the last sync) ──► text, finish_reason
        ──► correct = finished with end-of-sequence  and  checker(text, answer) ≥ 1
    accuracy = correct / N

Any tokenizer, any length, any task: the checker is the task's own answer check (``exact`` for
arithmetic, ``math`` for math text), never the shaped training reward (a format bonus is not
a right answer). A completion cut at ``max_tokens`` counts as wrong, as in training.

For the tiny character model this equals its teacher-forced check
(:func:`grpo_nb.tiny_model.greedy_accuracy`: greedy reproduces ``answer + <eos>`` exactly
when the argmax is right at every position) — up to float ties between the two engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_nb.llm.data import Prompt


@dataclass
class EvalResult:
    """Greedy accuracy on the held-out prompts, with a few samples to show."""

    accuracy: float
    n: int
    truncated: int  # completions that hit max_tokens (scored wrong)
    samples: list[tuple[str, str, bool]] = field(default_factory=list)  # (text, answer, ok)


def answer_checker(name: str) -> Callable[[str, str], float]:
    """The task's answer check by reward name: ``exact`` (arithmetic) or ``math`` (text)."""
    from grpo_nb.tasks import make_reward

    return make_reward(name)


async def greedy_accuracy(client: Any, prompts: Sequence[Prompt],
                          checker: Callable[[str, str], float], max_tokens: int, *,
                          batch: int = 64, keep_samples: int = 3,
                          cache_salt: str | None = None) -> EvalResult:
    """Greedy-decode every prompt through ``client`` (a ``CompletionsClient``) and score it.

    ``batch`` prompts go in one request (vLLM batches them itself); the client's
    ``max_in_flight`` bounds how many such requests run at once. ``cache_salt`` (the served
    weight version) keeps vLLM from reusing prompt KV that other weights computed.
    """
    if not prompts:
        return EvalResult(float("nan"), 0, 0)

    async def chunk(part: Sequence[Prompt]) -> list[Any]:
        outs = await client.complete([list(p.ids) for p in part], max_tokens=max_tokens,
                                     temperature=0.0, n=1,
                                     **({"cache_salt": cache_salt} if cache_salt else {}))
        if len(outs) != len(part):
            raise RuntimeError(f"evaluation: {len(part)} prompts, {len(outs)} completions")
        return outs

    parts = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    results = await asyncio.gather(*(chunk(p) for p in parts))
    correct = truncated = 0
    samples: list[tuple[str, str, bool]] = []
    for prompt, out in zip(prompts, (o for outs in results for o in outs), strict=True):
        if out.prompt_token_ids is not None and list(out.prompt_token_ids) != list(prompt.ids):
            raise RuntimeError("evaluation: completions came back out of prompt order")
        stopped = out.finish_reason == "stop"
        truncated += out.finish_reason == "length"
        ok = stopped and checker(out.text, prompt.answer) >= 1.0
        correct += ok
        if len(samples) < keep_samples:
            samples.append((out.text, prompt.answer, ok))
    return EvalResult(correct / len(prompts), len(prompts), truncated, samples)
