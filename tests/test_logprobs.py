"""grpo_nb.logprobs: chunked log-probs from hidden states and lm_head against the naive
``log_softmax(model(...).logits)`` path, in values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_nb import grpo
from grpo_nb.logprobs import linear_head, linear_logprobs, model_logprobs


def _naive(hidden, weight, bias, targets, temperature):
    z = F.linear(hidden, weight, bias).float() / temperature
    lp = torch.log_softmax(z, -1)
    return lp.gather(-1, targets[:, None])[:, 0], -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_logprobs_match_naive_in_values_entropy_and_gradients(chunk, temperature, bias):
    g = torch.Generator().manual_seed(0)
    n, h, v = 13, 8, 37
    head = torch.nn.Linear(h, v, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
        if bias:
            head.bias.copy_(torch.randn(v, generator=g))
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)  # an arbitrary dL/dlogp, not a plain sum

    lp, ent = linear_logprobs(hidden, head, targets, temperature, chunk_size=chunk, entropy=True)
    (lp * upstream).sum().backward()
    got = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])

    ref_head = copy.deepcopy(head)
    ref_head.zero_grad()
    x = hidden.detach().clone().requires_grad_()
    ref_lp, ref_ent = _naive(x, ref_head.weight, ref_head.bias, targets, temperature)
    (ref_lp * upstream).sum().backward()
    want = [x.grad, ref_head.weight.grad] + ([ref_head.bias.grad] if bias else [])

    assert lp.dtype == torch.float32 and ent is not None and not ent.requires_grad
    torch.testing.assert_close(lp, ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _model(tied: bool, vocab: int = 41):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():  # a non-trivial head (the default init is tiny)
        model.lm_head.weight.normal_(0.0, 0.5)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def _inputs(vocab: int = 41):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 9), generator=g)
    attn = torch.ones_like(ids)
    attn[2, 6:] = 0  # right padding
    mask = torch.zeros(3, 8)
    mask[0, 3:] = 1
    mask[1, 1:6] = 1
    mask[2, 2:5] = 1
    return ids, attn, mask, torch.randn(3, 8, generator=g)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_model_logprobs_match_full_logits_at_masked_positions(tied, temperature):
    """Values, entropy and every parameter's gradient (the shared embedding of a tied head
    included) equal those of the full-logits path; positions outside the mask hold 0."""
    model = _model(tied)
    ref = copy.deepcopy(model)
    ids, attn, mask, upstream = _inputs()

    lp, ent = model_logprobs(model, ids, attn, temperature, mask=mask, entropy=True,
                             chunk_size=4)
    (lp * upstream).sum().backward()

    logits = ref(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
    full = torch.log_softmax(logits, -1)
    ref_lp = full.gather(-1, ids[:, 1:, None])[..., 0]
    (ref_lp * upstream * mask).sum().backward()

    keep = mask != 0
    torch.testing.assert_close(lp[keep], ref_lp.detach()[keep], rtol=1e-5, atol=1e-5)
    assert lp[~keep].abs().max() == 0 and ent is not None and ent[~keep].abs().max() == 0
    ref_ent = -(full.exp() * full).sum(-1).detach()
    torch.testing.assert_close(ent[keep], ref_ent[keep], rtol=1e-5, atol=1e-5)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # float32 summation order: measured ≤ 6e-7
        want = ref_params[name].grad
        assert (p.grad - want).abs().max() <= 1e-5 * want.abs().max(), name
    # without a mask: every position, same values where both are computed
    with torch.no_grad():
        every, _ = model_logprobs(model, ids, attn, temperature)
    torch.testing.assert_close(every, ref_lp.detach(), rtol=1e-5, atol=1e-5)


def test_sequence_logprobs_and_entropy_equal_the_full_logits_path():
    """grpo's entry points: the chunked path and the one over ``model(...).logits`` (taken
    when the head is not a plain linear one) agree in log-probs and token-mean entropy."""
    model = _model(tied=True)
    ids, attn, mask, _ = _inputs()
    with torch.no_grad():
        lp, ent = grpo.sequence_logprobs_and_entropy(model, ids, attn, 0.8, mask=mask)
        logits = grpo.next_token_logits(model, ids, attn)
        ref = grpo.token_logprobs(logits, ids[:, 1:], 0.8) * mask
        torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
        assert ent == pytest.approx(grpo.masked_entropy(logits, mask, 0.8), rel=1e-5)
        torch.testing.assert_close(grpo.sequence_logprobs(model, ids, attn, 0.8),
                                   grpo.token_logprobs(logits, ids[:, 1:], 0.8))
        model.config.final_logit_softcapping = 30.0  # not a plain head: the fallback path
        assert linear_head(model) is None
        lp2, ent2 = grpo.sequence_logprobs_and_entropy(model, ids, attn, 0.8, mask=mask)
        torch.testing.assert_close(lp2, ref, rtol=1e-5, atol=1e-5)
        assert ent2 == pytest.approx(ent, rel=1e-5)


def test_bf16_autocast_matches_the_full_logits_path():
    """Under bf16 autocast (the trainer's GPU mode) the head's matmul runs in bf16 as
    ``model(...).logits`` does, the log-prob math in float32, the gradients land in float32."""
    model = _model(tied=True, vocab=300)
    ref = copy.deepcopy(model)
    ids, attn, mask, upstream = _inputs(vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = model_logprobs(model, ids, attn, 1.0, mask=mask, chunk_size=5)
        ref_lp = grpo.token_logprobs(grpo.next_token_logits(ref, ids, attn), ids[:, 1:])
    (lp * upstream).sum().backward()
    (ref_lp * upstream * mask).sum().backward()
    assert lp.dtype == torch.float32
    keep = mask != 0
    torch.testing.assert_close(lp[keep], ref_lp.detach()[keep], rtol=0, atol=2e-2)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        scale = ref_params[name].grad.abs().max()
        assert (p.grad - ref_params[name].grad).abs().max() <= 3e-2 * scale, name


class _Largest(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_all_rows_logits_exists_in_forward_or_backward():
    """The point of the module: at most one chunk's ``[rows, V]`` logits at a time, in the
    forward and in the backward (which recomputes them), whatever the number of rows."""
    n, h, v, chunk = 48, 2, 500, 4  # h < chunk: the [V, H] weight gradient is below one chunk
    head = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    with _Largest() as seen:
        lp, _ = linear_logprobs(hidden, head, targets, 0.9, chunk_size=chunk, entropy=True)
    assert seen.largest == chunk * v
    with _Largest() as seen:
        (lp * torch.randn(n)).sum().backward()
    assert seen.largest == chunk * v
    assert hidden.grad is not None and head.weight.grad is not None


def test_errors():
    head = torch.nn.Linear(2, 3)
    with pytest.raises(ValueError, match="hidden"):
        linear_logprobs(torch.zeros(2, 2), head, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(torch.zeros(2, 2), head, torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_logprobs(torch.zeros(2, 2), head, torch.zeros(2, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="lm_head"):
        model_logprobs(torch.nn.Linear(2, 2), torch.zeros(1, 3, dtype=torch.long),
                       torch.ones(1, 3))


@pytest.mark.slow
def test_memory_benchmark_small_runs_both_paths_and_they_agree():
    """``benchmarks/logprob_memory.py --small``: one JSON line; the two paths' loss, entropy
    and gradients agree to float32 precision (its memory and time ratios need the full size)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "logprob_memory.py"
    done = subprocess.run([sys.executable, str(script), "--small", "--batch", "2", "--seq", "24",
                           "--prompt", "8", "--repeats", "1", "--threads", "1"],
                          capture_output=True, text=True, check=True, timeout=300)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"peak_ratio", "time_ratio", "old", "new"} <= report.keys()
    assert report["old"]["peak_mib"] > 0 and report["new"]["time_s"] > 0
    for key in ("loss_rel_diff", "entropy_rel_diff", "grad_rel_diff"):
        assert report[key] <= 1e-5, (key, report)
