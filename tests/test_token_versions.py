"""Per-token weight versions: vLLM's spans mapped onto tokens, the sampler's groups, admission
on a group's oldest token, the lag metrics in rows, summary and dashboard, and a real server
whose version label changes while a request decodes."""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import pytest
from fake_vllm import FakeVLLM

from grpo_nb.llm.config import LLMConfig
from grpo_nb.llm.data import Group, Prompt, Rollout
from grpo_nb.llm.rollouts import sample_group, token_lags, token_versions
from grpo_nb.serving.client import CompletionError, CompletionsClient, span_labels


def _spans(*parts: tuple[str, int, int]) -> list[dict[str, Any]]:
    return [{"version": v, "start": s, "end": e} for v, s, e in parts]


def test_spans_map_onto_token_indexes_exactly() -> None:
    assert span_labels(_spans(("3", 0, 2), ("4", 2, 5)), 5) == ["3", "3", "4", "4", "4"]
    assert span_labels(_spans(("7", 0, 1), ("8", 1, 2)), 2) == ["7", "8"]
    assert span_labels(_spans(("0", 0, 0)), 0) == []
    for bad, n in ((_spans(("3", 0, 2), ("4", 3, 5)), 5),  # a gap
                   (_spans(("3", 0, 3), ("4", 2, 5)), 5),  # an overlap
                   (_spans(("3", 1, 5)), 5),  # not from token 0
                   (_spans(("3", 0, 4)), 5)):  # short of the last token
        with pytest.raises(ValueError, match="weight_versions"):
            span_labels(bad, n)
    # integers from the labels; the version at submit where a label is none (vLLM's "default")
    assert token_versions(["3", "3", "default", "4"], 4, fallback=2) == [3, 3, 2, 4]
    assert token_versions(None, 3, fallback=5) == [5, 5, 5]


def _choice(ids: list[int], spans: list[dict[str, Any]] | None, reason: str = "length",
            text: str = "7") -> dict[str, Any]:
    """One choice of /inference/v1/generate with output_mode "text", as vLLM 0.32 sends it."""
    return {"index": 0, "finish_reason": reason, "token_ids": ids, "text": text,
            "weight_versions": spans,
            "logprobs": {"content": [{"token": str(t), "logprob": -0.5 - i, "bytes": [49]}
                                     for i, t in enumerate(ids)]}}


def _answering(fake: FakeVLLM, replies: list[list[dict[str, Any]]]) -> CompletionsClient:
    """A client of ``fake``, whose generate requests are answered, in turn, by these lists
    of choices."""
    replies_iter = iter(replies)
    fake.answer = lambda r: ((200, {"request_id": "r", "output_mode": "text",
                                    "choices": next(replies_iter)})
                             if r.route == "/inference/v1/generate" else None)
    return CompletionsClient(fake.base_url, "m")


def test_the_sampler_gives_every_token_its_version(fake_vllm) -> None:
    client = _answering(fake_vllm, [[
        _choice([5, 6, 7], _spans(("3", 0, 1), ("4", 1, 3))),
        _choice([5, 6], _spans(("4", 0, 2)), reason="stop")]])
    group = asyncio.run(sample_group(client, Prompt("q", [1, 2], "7"), LLMConfig(group_size=2).resolve(),
                                     lambda: 3, seed=11))
    (request,) = fake_vllm.requests
    body = request.body
    assert request.route == "/inference/v1/generate" and body["token_ids"] == [1, 2]
    assert body["cache_salt"] == "policy-v3" and body["output_mode"] == "text"
    assert body["sampling_params"]["n"] == 2 and body["sampling_params"]["seed"] == 11
    a, b = group.rollouts
    assert a.token_versions == [3, 4, 4] and b.token_versions == [4, 4]
    assert a.sampler_logprobs == [-0.5, -1.5, -2.5] and a.completion_text == "7"
    assert group.policy_version == 3  # its oldest token's


def test_an_aborted_choice_keeps_its_tokens_versions_and_a_bad_span_fails(fake_vllm) -> None:
    client = _answering(fake_vllm, [[_choice([5, 6], _spans(("2", 0, 2)), "abort")],
                                    [_choice([5, 6], _spans(("2", 0, 1)))]])
    (cut,) = asyncio.run(client.generate([1], n=1))
    assert cut.finish_reason == "abort" and cut.versions == ["2", "2"]
    with pytest.raises(CompletionError, match="malformed weight_versions"):
        asyncio.run(client.generate([1], n=1))
    assert client.stats.aborted == 1 and client.stats.http_5xx == 1


def test_admission_reads_a_groups_oldest_token(fake_vllm, random_model_dir) -> None:
    """At step 3 with max_staleness 1: a group submitted at version 1 whose tokens all came from
    versions 2 and 3 is admitted; one whose first tokens came from version 1 is dropped, however
    new its last ones are."""
    from llm_trainer import built_trainer

    client = _answering(fake_vllm, [
        [_choice([5, 6, 7], _spans(("2", 0, 2), ("3", 2, 3)))] * 2,  # fresh enough
        [_choice([5, 6, 7], _spans(("1", 0, 1), ("3", 1, 3)))] * 2,  # oldest token too old
        [_choice([5, 6], _spans(("3", 0, 2)))] * 2])
    cfg = LLMConfig(group_size=2, prompts_per_step=2, max_staleness=1).resolve()
    groups = [asyncio.run(sample_group(client, Prompt("q", [1], "7"), cfg, lambda: 1,
                                       group_id=i)) for i in range(3)]

    with built_trainer(random_model_dir, cfg, groups=groups, step=3) as t:
        kept = asyncio.run(asyncio.wait_for(t.collect(2, t.keep), 5.0))
        assert [g.group_id for g in kept] == [0, 2] and t.ledger.stale == 1
        assert t.rows == [{"kind": "dropped", "step": 3, "staleness": 2, "total": 1}]


def _rollout(versions: list[int]) -> Rollout:
    return Rollout([5] * len(versions), [-1.0] * len(versions), "", "stop",
                   token_versions=versions)


def test_token_lags_and_the_run_summary() -> None:
    from grpo_nb.llm.summary import summarize
    from grpo_nb.metrics import MetricsRecorder

    g = Group(0, "p", "a", [1], [_rollout([2, 2, 3]), _rollout([3, 3]), _rollout([1, 1])], 1,
              0.0, 1.0)
    lags = token_lags([g], trainer_version=3)
    assert lags == {"token_lag_mean": pytest.approx(6 / 7), "token_lag_max": 2,
                    "token_lag_counts": [3, 2, 2], "mixed_version_frac": pytest.approx(1 / 3)}
    assert token_lags([], 0) == {"token_lag_mean": 0.0, "token_lag_max": 0,
                                 "token_lag_counts": [], "mixed_version_frac": 0.0}

    rec = MetricsRecorder(None)
    for step, (mean, top, mixed, capped) in enumerate([(0.5, 1, 0.25, 0.0), (1.0, 2, 0.75, 0.1)],
                                                      start=1):
        rec.log("step", step=step, token_lag_mean=mean, token_lag_max=top,
                mixed_version_frac=mixed, tis_capped_frac=capped)
    r = summarize(rec, LLMConfig(), 1.0, 0)
    assert (r.token_lag_mean, r.token_lag_max, r.mixed_version_frac,
            r.tis_capped_frac_mean) == (0.75, 2, 0.5, 0.05)
    empty = summarize(MetricsRecorder(None), LLMConfig(), 1.0, 0)
    assert math.isnan(empty.token_lag_max) and math.isnan(empty.mixed_version_frac)


def test_the_step_row_has_the_tis_statistics_and_the_largest_ratio(random_model_dir,
                                                                     monkeypatch) -> None:
    """``tis_capped_frac`` (the loss's ``tis_frac_capped``) and ``ratio_max``: the largest over
    the last update's micro-batches, not their mean."""
    from grpo_nb import grpo
    from grpo_nb.llm.policy import PolicyTrainer, load_policy

    real, seen = grpo.policy_loss, []

    def recording(*args: Any, **kwargs: Any) -> Any:
        loss, metrics = real(*args, **kwargs)
        seen.append(metrics)
        return loss, metrics

    monkeypatch.setattr(grpo, "policy_loss", recording)
    model, tok = load_policy(random_model_dir)
    cfg = LLMConfig(prompts_per_step=2, group_size=2, grad_accum=2, lr=5e-2, num_iterations=3,
                    ratio_against="trainer", tis_cap=2.0)
    # sampler log-probs far below the trainer's: every TIS weight hits the cap
    groups = [Group(i, "p", "a", prompt, [
        Rollout(c, [-30.0] * len(c), "", "stop", advantage=adv) for c, adv in
        zip(completions, (1.0, -1.0), strict=True)], 0, 0.0, 1.0)
        for i, (prompt, completions) in enumerate([([3, 4, 5], [[6, 7, 1], [8, 9, 1]]),
                                                   ([3, 4], [[6, 1], [9, 1]])])]
    row = PolicyTrainer(model, tok, cfg).step(groups)
    assert row["tis_capped_frac"] == 1.0 and row["tis_weight_mean"] == pytest.approx(2.0)
    last = [m["ratio_max"] for m in seen[-2:]]  # the last update's two micro-batches
    assert last[0] != last[1] and row["ratio_max"] == max(last)


def test_the_dashboard_draws_token_lag_and_tis() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from grpo_nb.llm.dashboard import llm_figure
    from grpo_nb.metrics import MetricsRecorder

    rec = MetricsRecorder(None)
    for step, counts in enumerate([[10], [6, 4], [2, 6, 2]], start=1):
        rec.log("step", t=float(step), step=step, tokens=10, token_lag_counts=counts,
                mixed_version_frac=0.5, tis_weight_mean=1.0, tis_capped_frac=0.1, ratio_max=1.2)
    panels = {ax.get_label(): ax for ax in llm_figure(rec, window_s=None).axes}
    (image,) = panels["lag"].get_images()
    assert image.get_array().tolist() == [[1.0, 0.6, 0.2], [0.0, 0.4, 0.6], [0.0, 0.0, 0.2]]
    assert "split by a sync: 50%" in panels["lag"].get_title()
    assert [list(line.get_ydata()) for line in panels["tis"].lines] == [[1.0] * 3, [0.1] * 3,
                                                                       [1.2] * 3]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_label_changed_mid_request_splits_one_completion(vllm_server) -> None:
    """``/update_weight_version`` while a request decodes: each of its completions carries the
    old label on its first tokens and the new one on the rest, through the sampler's route."""
    from grpo_nb.serving.control import VLLMControlClient

    control = VLLMControlClient(vllm_server.url, api_key=vllm_server.api_key)
    before = control.weight_version()
    control.set_weight_version("900")

    def relabel() -> None:
        assert control.wait_running(1, timeout=300)
        control.set_weight_version("901")

    async def go() -> list[Any]:
        async with CompletionsClient.for_server(vllm_server) as client:
            return await client.generate([3, 4, 5], max_tokens=150, ignore_eos=True, n=2,
                                         cache_salt="test-label")

    thread = threading.Thread(target=relabel)
    thread.start()
    try:
        outs = asyncio.run(go())
    finally:
        thread.join()
        control.set_weight_version(before or "default")
    assert len(outs) == 2
    for out in outs:
        versions = token_versions(out.versions, len(out.token_ids), fallback=-1)
        k = versions.count(900)
        assert out.finish_reason == "length" and len(out.logprobs) == len(versions) == 150
        assert 0 < k < 150 and versions == [900] * k + [901] * (150 - k), out.versions
