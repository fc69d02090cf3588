"""``WeightSyncConfig.kv="recompute"``: a completion a sync cuts is resubmitted as prompt + the
tokens it produced, once per sync, and no group is lost; against a real server, its tokens
after the sync carry the new version and agree with the trainer's log-probs under the new
weights to the floor; with ``"keep"`` they do not (the stale KV, measured)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Prompt
from grpo_nb.llm.rollouts import logprob_tolerance, sample_group
from grpo_nb.serving.client import CompletionsClient
from grpo_nb.weight_sync import WeightSyncConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
LONG = 120  # tokens a completion: EOS ignored, still decoding when the sync lands


def _choice(ids: list[int], version: str, reason: str) -> dict[str, Any]:
    """One choice of /inference/v1/generate (output_mode "text"), as vLLM 0.32 sends it."""
    return {"index": 0, "finish_reason": reason, "token_ids": ids, "text": "".join(map(str, ids)),
            "weight_versions": [{"version": version, "start": 0, "end": len(ids)}],
            "logprobs": {"content": [{"token": str(t), "logprob": -float(t), "bytes": [49]}
                                     for t in ids]}}


def _answering(monkeypatch: pytest.MonkeyPatch, replies: list[list[dict[str, Any]]]
               ) -> tuple[CompletionsClient, list[dict[str, Any]]]:
    """A client whose requests are answered, in turn, by these lists of choices (parsed)."""
    sent, replies_iter = [], iter(replies)

    async def post(self: CompletionsClient, body: dict[str, Any], url: str) -> list[Any]:
        sent.append(body)
        choices = next(replies_iter, None)
        assert choices is not None, f"request {len(sent)}: more than the answers planned"
        return self._parse({"choices": choices}, 0.0)

    monkeypatch.setattr(CompletionsClient, "_post_with_retries", post)
    return CompletionsClient("http://127.0.0.1:9/v1", "m"), sent


def _recompute(**kw: Any) -> LLMConfig:
    return LLMConfig(sync=WeightSyncConfig(pause_mode="none", kv="recompute"), **kw)


def test_recompute_resubmits_prompt_and_produced_tokens_once_per_sync(monkeypatch) -> None:
    """Two syncs cut choice 0 (after 2 tokens, then after 1 more), one cuts choice 1 before its
    first token: each cut is resubmitted once, as prompt + every token so far, ``n`` 1, with
    what is left of ``max_tokens``; the group comes back whole, its parts joined in order."""
    client, sent = _answering(monkeypatch, [  # the fake answers at once: choice 0 ends first
        [_choice([5, 6], "3", "abort"), _choice([], "3", "abort")],
        [_choice([7], "4", "abort")],  # choice 0, cut again by the second sync
        [_choice([12, 13], "5", "stop")],  # choice 0, after the second sync
        [_choice([8, 9, 10, 11], "4", "length")]])  # choice 1, resubmitted once
    cfg = _recompute(group_size=2, max_tokens=5)
    group = asyncio.run(sample_group(client, Prompt("q", [1, 2], "7"), cfg, lambda: 3,
                                     group_id=9))
    first, *again = sent
    assert first["token_ids"] == [1, 2] and first["sampling_params"]["n"] == 2
    assert {b["cache_salt"] for b in sent} == {"policy-v3"}
    resent = sorted((b["token_ids"], b["sampling_params"]["max_tokens"],
                     b["sampling_params"]["n"]) for b in again)
    assert resent == [([1, 2], 5, 1), ([1, 2, 5, 6], 3, 1), ([1, 2, 5, 6, 7], 2, 1)]
    assert group.group_id == 9 and len(group.rollouts) == 2
    a, b = group.rollouts
    assert a.completion_ids == [5, 6, 7, 12, 13] and a.finish_reason == "stop"
    assert a.sampler_logprobs == [-5.0, -6.0, -7.0, -12.0, -13.0]
    assert a.token_versions == [3, 3, 4, 5, 5] and a.completion_text == "5671213"
    assert b.completion_ids == [8, 9, 10, 11] and b.token_versions == [4] * 4
    assert group.policy_version == 3


def test_keep_resamples_an_aborted_group_and_recompute_refuses_pause_abort(monkeypatch) -> None:
    client, sent = _answering(monkeypatch, [
        [_choice([5], "3", "abort"), _choice([4], "3", "stop")],
        [_choice([5, 6], "4", "stop"), _choice([7], "4", "stop")]])
    aborted: list[int] = []
    group = asyncio.run(sample_group(client, Prompt("q", [1], "7"), LLMConfig(group_size=2),
                                     lambda: 4, on_abort=lambda: aborted.append(1)))
    assert [b["token_ids"] for b in sent] == [[1], [1]] and aborted == [1]
    assert [r.completion_ids for r in group.rollouts] == [[5, 6], [7]]
    for mode in ("abort", "wait"):
        with pytest.raises(ValueError, match="WeightSyncConfig.kv='recompute'"):
            WeightSyncConfig(pause_mode=mode, kv="recompute")
    with pytest.raises(ValueError, match="WeightSyncConfig.kv="):
        WeightSyncConfig(kv="reuse")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def stale_kv() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import stale_kv

        yield stale_kv
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_after_a_recompute_sync_tokens_carry_the_new_version_at_the_floor(
        ring_server, tiny_model_dir, stale_kv) -> None:
    """Long completions (EOS ignored), a sync mid-flight to weights one Adam step at lr 3e-3
    away (``benchmarks/stale_kv.py``: the stale KV shows at the ring's 3e-4 too). ``recompute``:
    every cut completion was resubmitted exactly once with prompt + its tokens, its tokens after
    the sync carry the new version, and their log-probs agree with the trainer's under the new
    weights within the fp32 tolerance; ``keep``: the same tokens, over stale KV, do not."""
    import torch

    from grpo_nb.llm.policy import load_policy
    from grpo_nb.weight_sync import WeightSyncer

    base, _ = load_policy(tiny_model_dir)
    new = stale_kv.bumped(base, 3e-3, 1, seed=0)
    served = stale_kv.copy.deepcopy(base)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, int(base.config.vocab_size), (8,), generator=gen).tolist()
               for _ in range(4)]
    params = {"max_tokens": LONG, "temperature": 1.0, "ignore_eos": True, "seed": 0}
    tol = logprob_tolerance("float32")
    after: dict[str, list[float]] = {}
    for step, kv in enumerate(("keep", "recompute")):
        v0 = 300 + 2 * step
        with WeightSyncer(ring_server.url, served,
                          WeightSyncConfig(pause_mode="none", kv=kv, verify=False)) as syncer:
            served.load_state_dict(base.state_dict())
            syncer.sync(v0)
            served.load_state_dict(new.state_dict())
            outs, calls, _ = stale_kv.cut_by_a_sync(ring_server, prompts, params, syncer, v0 + 1)
        per_token = stale_kv.gaps(outs, prompts, {v0: base, v0 + 1: new}, 1.0)
        cut = [i for i, c in enumerate(per_token) if {v for v, _ in c} == {v0, v0 + 1}]
        assert cut, f"kv={kv}: no completion was cut by the sync"
        assert all(len(o.token_ids) == LONG for o in outs)
        after[kv] = [g for i in cut for v, g in per_token[i] if v == v0 + 1]
        if kv == "recompute":  # fresh KV: at the floor; the old version on a prefix, then the new
            mean = sum(after[kv]) / len(after[kv])
            assert mean < tol / 10 and max(after[kv]) < tol, (mean, max(after[kv]), tol)
            versions = [[v for v, _ in c] for c in per_token]
            old = [vs.count(v0) for vs in versions]
            assert all(vs == [v0] * k + [v0 + 1] * (LONG - k)
                       for vs, k in zip(versions, old, strict=True))
            # each prompt sent once, and once more per sync that cut it: with what it had made
            resent = [prompts[i] + outs[i].token_ids[:k] for i, k in enumerate(old) if k < LONG]
            assert sorted(calls) == sorted(prompts + resent)
    keep = sum(after["keep"]) / len(after["keep"])
    assert keep > 10 * tol, (keep, tol)  # the stale KV

