"""Notebook 05's step-by-hand helpers: the alignment they show, the loss checker they run."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

from grpo_nb.llm.by_hand import (  # noqa: E402
    alignment_rows,
    draw_alignment,
    served_logprobs,
    token_loss_problems,
)
from grpo_nb.llm.data import Group, Rollout  # noqa: E402
from grpo_nb.llm.policy import make_batch  # noqa: E402


class _Chars:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def _group() -> Group:
    prompt = [1, 2, 3]
    rollouts = [Rollout([4, 5], [-0.1, -0.2], "ef", "stop", advantage=1.0),
                Rollout([6, 7, 8, 9], [-0.3, -0.4, -0.5, -0.6], "ghij", "stop", advantage=-1.0)]
    return Group(0, "bcd", "x", prompt, rollouts, 0, 0.0, 0.0)


def test_rows_put_completion_token_k_at_column_p_minus_1_plus_k() -> None:
    batch = make_batch([_group()], pad_id=0)
    rows = alignment_rows(batch, 1, _Chars(), prompt_len=3)
    assert len(rows) == 3 + 4 - 1  # one loss column per predicted token
    completion = [r for r in rows if r["part"] == "completion"]
    assert [r["column t"] for r in completion] == [2, 3, 4, 5]  # p - 1 = 2 onwards
    assert [r["predicts token t+1"] for r in completion] == ["g", "h", "i", "j"]
    assert [r["sampler logp"] for r in completion] == [-0.3, -0.4, -0.5, -0.6]
    assert all(r["loss_mask"] == (r["part"] == "completion") for r in rows)
    short = alignment_rows(batch, 0, _Chars(), prompt_len=3)
    assert len(short) == 4  # the padding of the shorter row is not shown


def test_draw_alignment_marks_each_rows_first_loss_column() -> None:
    fig = draw_alignment(make_batch([_group()], pad_id=0), [3, 3])
    mask_ax = fig.axes[0]
    marks = mask_ax.collections[0].get_offsets()
    assert [tuple(m) for m in marks.tolist()] == [(2.0, 0.0), (2.0, 1.0)]


def _right(logp, old, adv, mask):
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    return -(surrogate * mask).sum() / mask.sum()


def test_checker_accepts_the_masked_token_mean_loss() -> None:
    assert token_loss_problems(_right) == []


def test_checker_catches_the_usual_slips() -> None:
    def sign_slip(logp, old, adv, mask):
        return -_right(logp, old, adv, mask)

    def mean_over_padding(logp, old, adv, mask):
        ratio = torch.exp(logp - old)
        s = torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
        return -s.mean()

    def no_clip(logp, old, adv, mask):
        return -(torch.exp(logp - old) * adv[:, None] * mask).sum() / mask.sum()

    def per_sequence_mean(logp, old, adv, mask):
        ratio = torch.exp(logp - old)
        s = torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
        return -((s * mask).sum(1) / mask.sum(1)).mean()

    for slip in (sign_slip, mean_over_padding, no_clip, per_sequence_mean):
        assert token_loss_problems(slip), slip.__name__


def test_checker_catches_a_loss_without_gradient() -> None:
    def detached(logp, old, adv, mask):
        return _right(logp.detach(), old, adv, mask)

    problems = token_loss_problems(detached)
    assert problems and "gradient" in problems[0]


def test_served_logprobs_score_exactly_the_completion_tokens(fake_vllm) -> None:
    from types import SimpleNamespace

    from grpo_nb.serving.control import VLLMControlClient

    fake_vllm.prompt_logprob = lambda seq, i: -float(i)  # token i given those before it: -i
    syncer = SimpleNamespace(client=VLLMControlClient(fake_vllm.url, timeout=30))
    out = served_logprobs(syncer, [_group()])
    assert [t.tolist() for t in out] == [[-3.0, -4.0], [-3.0, -4.0, -5.0, -6.0]]
    assert fake_vllm.sampled[1]["prompt"] == [1, 2, 3, 6, 7, 8, 9]
