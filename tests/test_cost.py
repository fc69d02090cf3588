"""The step cost model (grpo_nb.llm.cost) on synthetic metric rows, and its GPU memory plan
from model shapes (checked against what transformers builds and torch saves): no server.

Every expected value below is worked out by hand from the rows or shapes written in the test."""

from __future__ import annotations

import dataclasses
import itertools
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_nb.llm import cost
from grpo_nb.llm.cost import (
    loop_seconds,
    predict,
    steady_intervals,
    steady_sync_phases,
    step_phases,
)


def step(t: float, n: int, train: float, age: list[float], wall: float = 0.0) -> dict[str, Any]:
    return {"kind": "step", "t": t, "step": n, "train_s": train, "age_s": age, "wall_s": wall}


def sync(t: float, n: int, ms: float) -> dict[str, Any]:
    return {"kind": "sync", "t": t, "step": n, "ms": ms}


def sync_run() -> list[dict[str, Any]]:
    """Four steps; step 4's interval holds an eval."""
    return [
        {"kind": "sync", "t": 8.0, "step": 0, "ms": 500.0},  # before the loop: never counted
        step(10.0, 1, 0.2, [1.0, 0.9], wall=1.0),
        sync(10.1, 1, 100.0),
        step(11.0, 2, 0.3, [0.8, 0.7]),       # 1.0 s: train .3, sync .1, generate .8 − .3 = .5
        {"kind": "busy", "t": 11.1, "actor": "gen0", "label": "generate", "start": 11, "end": 11.1},
        sync(11.2, 2, 200.0),
        step(12.5, 3, 0.4, [1.0, 0.2]),       # 1.5 s: train .4, sync .2, generate 1.0 − .4 = .6
        sync(12.6, 3, 100.0),
        {"kind": "eval", "t": 13.0, "step": 3, "accuracy": 0.5},
        step(14.0, 4, 0.3, [0.9]),            # holds the eval: left out
    ]


def test_steady_intervals_by_hand() -> None:
    ivs = steady_intervals(sync_run())
    assert [round(iv["step"], 9) for iv in ivs] == [1.0, 1.5]
    assert [iv["train"] for iv in ivs] == [0.3, 0.4]
    assert [iv["sync"] for iv in ivs] == [0.1, 0.2]
    assert [round(iv["generate"], 9) for iv in ivs] == [0.5, 0.6]


def test_step_phases_means_and_wait() -> None:
    p = step_phases(sync_run())
    assert p.steps == 2
    assert p.step == pytest.approx(1.25)
    assert p.train == pytest.approx(0.35)
    assert p.sync == pytest.approx(0.15)
    assert p.generate == pytest.approx(0.55)
    assert p.wait == pytest.approx(1.25 - 0.35 - 0.15)  # 0.75: the trainer's idle time


def test_row_order_and_busy_rows_do_not_matter() -> None:
    rows = sync_run()
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    without_busy = [r for r in rows if r["kind"] != "busy"]
    assert step_phases(shuffled) == step_phases(rows) == step_phases(without_busy)


def test_predict_generation_bound() -> None:
    """G = .55 > T = .35: async step = G + S = .70; sync step = .55 + .35 + .15 = 1.05."""
    pr = predict(step_phases(sync_run()))
    phases = (pr.G, pr.T, pr.S)
    assert phases == pytest.approx((0.55, 0.35, 0.15))
    assert pr.sync_step == pytest.approx(1.05)
    assert pr.async_step == pytest.approx(0.70)
    assert pr.overlap_bound == pytest.approx(1.05 / 0.55)   # max(G, T + S) = max(.55, .50)
    assert pr.model_speedup == pytest.approx(1.5)            # 1.05 / .70
    # Without a pause (pause_mode="none") the sync hides behind generation too: max(G, T + S).
    free = predict(step_phases(sync_run()), paused=False)
    assert free.async_step == pytest.approx(0.55)
    assert free.model_speedup == pytest.approx(free.overlap_bound) == pytest.approx(1.05 / 0.55)


def test_without_a_pause_the_engine_still_stops_for_the_update() -> None:
    """Only the server-side phases (start, wait, load, finish) stop generation: step 2's sync
    holds 5 + 40 ms of them (its 30 ms version call does not count), step 3's 20 + 60 ms, so
    S_server = .0625 and the async step is max(G + S_server, T + S) = max(.6125, .50)."""
    rows = sync_run()
    rows[2] = {**rows[2], "phases": {"start": 5.0, "load": 40.0, "version": 30.0}}
    rows[5] = {**rows[5], "phases": {"wait": 20.0, "load": 60.0}}
    p = step_phases(rows)
    assert p.server_sync == pytest.approx(0.0625)
    free = predict(p, paused=False)
    assert free.S_server == pytest.approx(0.0625) and free.async_step == pytest.approx(0.6125)
    assert free.model_speedup == pytest.approx(1.05 / 0.6125)
    assert free.model_speedup < free.overlap_bound
    assert predict(p).async_step == pytest.approx(0.70)  # a paused sync: S_server is in S


def test_predict_training_bound() -> None:
    """G = .2 < T = .5, S = .1: the trainer sets the pace, sync is on its timeline either
    way, so the paused-server model and the overlap bound agree: .8 / .6."""
    rows = [step(0.0, 1, 0.5, [0.9]), sync(0.55, 1, 100.0), step(0.8, 2, 0.5, [0.7])]
    p = step_phases(rows)
    measured = (p.step, p.train, p.sync, p.generate)
    assert measured == pytest.approx((0.8, 0.5, 0.1, 0.2))
    pr = predict(p)
    assert pr.async_step == pytest.approx(0.6)
    assert pr.overlap_bound == pytest.approx(pr.model_speedup) == pytest.approx(0.8 / 0.6)


@pytest.mark.parametrize(("g", "t", "s"), list(itertools.product((0.1, 0.5, 2.0), repeat=3)))
def test_model_never_beats_overlap_bound_or_2x(g: float, t: float, s: float) -> None:
    """A paused server only takes away from overlap, and overlap hides at most the shorter
    of two phases: 1 < model speed-up ≤ overlap bound ≤ 2."""
    rows = [step(0.0, 1, t, [g + t]), sync(t + s / 2, 1, 1000 * s),
            step(g + t + s, 2, t, [g + t])]
    pr = predict(step_phases(rows))
    assert pr.sync_step == pytest.approx(g + t + s)
    assert 1 < pr.model_speedup <= pr.overlap_bound + 1e-12 <= 2 + 1e-12
    assert predict(step_phases(rows), paused=False).model_speedup == pytest.approx(
        pr.overlap_bound)


def test_sync_every_two_halves_s() -> None:
    """A sync only after even steps: one interval in two carries it, S = 0.2 / 2."""
    rows = [step(0.0, 1, 0.1, [0.5]), step(0.5, 2, 0.1, [0.5]), sync(0.7, 2, 200.0),
            step(1.2, 3, 0.1, [0.4]), step(1.7, 4, 0.1, [0.5]), sync(1.9, 4, 200.0),
            step(2.4, 5, 0.1, [0.4])]
    p = step_phases(rows)
    assert p.steps == 4
    assert p.sync == pytest.approx(0.1)
    assert p.step == pytest.approx(0.6)  # (0.5 + 0.7 + 0.5 + 0.7) / 4


def test_sync_phases_come_from_steady_steps_only() -> None:
    """The pre-loop sync (step 0) and the one inside step 4's eval interval are left out."""
    rows = sync_run()
    for i, load in ((0, 900.0), (2, 40.0), (5, 60.0), (7, 80.0), (8, 700.0)):
        if rows[i]["kind"] == "sync":
            rows[i] = {**rows[i], "phases": {"load": load, "version": 5.0}}
    rows.insert(9, {**sync(13.5, 3, 100.0), "phases": {"load": 700.0, "pause": 1.0}})
    assert steady_sync_phases(rows) == {"load": 50.0, "version": 5.0}


def test_checkpoints_and_skipped_steps_are_left_out() -> None:
    rows = [step(0.0, 1, 0.1, [0.5]), step(1.0, 2, 0.1, [0.5]),
            step(9.0, 3, 0.1, [0.5]),                      # after step 2's checkpoint
            {"kind": "skipped", "t": 9.5, "step": 3},
            step(12.0, 4, 0.1, [0.5]),                     # holds a skipped step: always out
            step(12.5, 5, 0.1, [0.5]),                     # after step 4's checkpoint
            step(13.0, 6, 0.1, [0.5])]
    assert [iv["step"] for iv in steady_intervals(rows)] == [1.0, 8.0, 0.5, 0.5]
    assert step_phases(rows).step == pytest.approx(2.5)
    assert [iv["step"] for iv in steady_intervals(rows, checkpoint_every=2)] == [1.0, 0.5]


def test_too_few_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="no steady step"):
        step_phases([step(0.0, 1, 0.1, [0.5])])


def test_loop_seconds() -> None:
    """From step 1's start (t − wall_s = 10 − 1) to the last step's row (14)."""
    assert loop_seconds(sync_run()) == pytest.approx(5.0)
    assert loop_seconds([]) == 0.0


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"


def test_other_load_counts_our_children_as_ours() -> None:
    """A child burning 1 CPU second is this tree's work, not the rest of the machine's."""
    with cost.OtherLoad() as load:
        subprocess.run([sys.executable, "-c", BURN], check=True, timeout=120)
    assert load.ours_s >= 0.9, load.ours_s


def test_other_load_counts_a_process_outside_our_tree_as_other() -> None:
    """A burner double-forked away (its parent is init) is the rest of the machine's work: the
    model's comparison is not made when such work takes the cores."""
    with cost.OtherLoad() as load:
        # the shell exits at once; run() returns when the burner, holding its stdout, ends
        subprocess.run(["sh", "-c", f"{sys.executable} -c '{BURN}' & exit 0"], check=True,
                       stdout=subprocess.PIPE, timeout=120)
    assert load.ours_s < 0.5, load.ours_s
    assert load.other_s >= 0.9 and load.cores > 0, load


# ── GPU memory of the single-GPU plan (cost.memory_plan), from shapes ──

QWEN06 = cost.QWEN3["Qwen3-0.6B"]
SMALL = cost.ModelShape(hidden=96, layers=2, vocab=160, heads=6, kv_heads=3, head_dim=8,
                        intermediate=160)


def _hf_model(shape: cost.ModelShape, layers: int | None = None) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=layers or shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied)).float()


@pytest.mark.parametrize("tied", [True, False])
def test_params_and_kv_per_token_follow_the_model(tied: bool) -> None:
    """The closed form counts what transformers builds; Qwen3-0.6B: 596,049,920 parameters
    (tied head) and 2 × 28 layers × 8 KV heads × 128 × 2 B = 114,688 B of KV per token."""
    shape = dataclasses.replace(SMALL, tied=tied)
    model = _hf_model(shape)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert QWEN06.params == 596_049_920
    assert QWEN06.kv_bytes_per_token("bfloat16") == 114_688
    assert QWEN06.kv_bytes_per_token("float32") == 2 * 114_688
    assert cost.ModelShape.from_hf(model.config.to_dict()) == shape


def _saved_bytes(shape: cost.ModelShape, layers: int, seq: int, batch: int = 2) -> int:
    """Bytes autograd saves in the base model's forward under bf16 autocast on the CPU,
    parameters left out, each storage once."""
    model = _hf_model(shape, layers)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, shape.vocab, (batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("shape", [SMALL, cost.ModelShape(128, 2, 160, 8, 8, 16, 320),
                                   cost.ModelShape(128, 2, 160, 16, 8, 128, 384)])
def test_a_layers_saved_activations_are_what_torch_saves(shape: cost.ModelShape) -> None:
    """One more layer saves ``layer_saved_per_token`` per token plus its weights' bf16 copies
    (autocast's cache: the forward's 2 B a parameter); counted with saved_tensors_hooks at two
    lengths, so the per-token part and the per-layer constant come apart."""
    per_layer = {seq: _saved_bytes(shape, 2, seq) - _saved_bytes(shape, 1, seq)
                 for seq in (16, 48)}
    per_token = (per_layer[48] - per_layer[16]) / (2 * 32)
    assert per_token == shape.layer_saved_per_token()
    layer_params = (shape.params - shape.vocab * shape.hidden - shape.hidden) // shape.layers
    norms = 2 * shape.hidden + 2 * shape.head_dim  # RMSNorm weights: float32, not cast
    assert per_layer[16] - 2 * 16 * per_token == 2 * (layer_params - norms)


def test_memory_plan_term_by_term_for_qwen3_06b() -> None:
    """The GPU run's batch (8 prompts × 8, 256 + 256 tokens: 32,768 tokens, 16,384 scored)
    and 2 × 64 requests in flight, each term worked out by hand."""
    plan = cost.memory_plan(QWEN06, sequences=64, prompt_len=256, completion_len=256,
                            server_seqs=128)
    p = 596_049_920
    layer = 32_768 * (82_088 + 8 * 1024)  # one layer recomputed + the residual's 2 gradients
    assert QWEN06.layer_saved_per_token() == 82_088
    assert plan.trainer_terms == {
        "weights_adam": 12 * p,                         # float32 weights + AdamW's 2 moments
        "checkpoints": 29 * 32_768 * 1024 * 4,          # 28 layer inputs + the final norm's
        "peak_phase": 4 * p + layer,                    # backward: float32 grads + one layer
        "head_rows": 2 * 16_384 * 1024 * 4,             # the scored rows' hidden and gradient
        "mask": 4 * 64 * 512 ** 2,                      # 4-D float32 padding mask
        "context": 1 << 29}
    assert plan.trainer_peak == 17_125_605_376          # 15.95 GiB
    # the forward's end is the smaller phase: bf16 weights + 441 rows of 151,936 logits × 10 B
    assert 2 * p + 10 * 441 * 151_936 < 4 * p + layer
    assert plan.server_terms == {"weights": 2 * p,
                                 "kv_cache": int(1.2 * (128 + 64) * 512 * 114_688),
                                 "overhead": 2 << 30}
    assert plan.server_need == 16_868_730_470           # 15.7 GiB


def test_fits_takes_the_servers_rounded_share_and_the_trainers_margin() -> None:
    plan = cost.MemoryPlan({"all": 10_000}, {"all": 2_001})
    assert cost.server_fraction(2_001, 20_000) == 0.11           # rounded up to 0.01
    assert plan.fits(20_000) == (0.11 * 20_000 + 1.1 * 10_000 <= 20_000)
    assert plan.fits(13_050) is False  # 0.16 × 13,050 + 1.1 × 10,000 = 13,088 (unrounded: 13,001)
    assert plan.fits(13_100) is True   # 0.16 × 13,100 + 11,000 = 13,096
    assert cost.server_fraction(16_868_730_470, 80 * 10**9) == 0.22


def test_readme_memory_table_is_memory_rows() -> None:
    """README's table rows are what :func:`cost.memory_rows` computes now."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = [line for line in text.splitlines() if line.startswith("| Qwen3-")
             and "× 8 × (256 + 256)" in line]
    assert shown == cost.memory_rows()
