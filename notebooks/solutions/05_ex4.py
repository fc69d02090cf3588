# ruff: noqa: F821
# server, model, sync_cfg and pair are notebook 05's: this file runs in its namespace.
import asyncio
from dataclasses import replace

from grpo_nb.serving.client import CompletionsClient
from grpo_nb.weight_sync import WeightSyncer


async def aborted_completions() -> list:
    # Join the transfer group first (it takes a moment), then start the requests, wait until
    # the server's own gauge says they decode (in a thread: this loop keeps sending them), sync.
    abort_cfg = replace(sync_cfg, pause_mode="abort", verify=False)
    with WeightSyncer(server.url, model, abort_cfg) as syncer:
        async with CompletionsClient.for_server(server) as client:
            in_flight = [asyncio.ensure_future(client.generate(
                pair[0].prompt_ids, max_tokens=200, temperature=1.0, ignore_eos=True))
                for _ in range(8)]
            await asyncio.to_thread(syncer.client.wait_running)
            await asyncio.to_thread(syncer.sync, 1)
            outs = [c for batch in await asyncio.gather(*in_flight) for c in batch]
    # A partial completion is not a sample of the policy and its reward would be wrong: the
    # ring's generators count it (an "aborted" row) and sample that group again.
    return [c for c in outs if c.finish_reason == "abort"]
