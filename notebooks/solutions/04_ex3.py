# ruff: noqa: F821
# server, prompt_ids, CompletionsClient, ClientConfig and VLLMControlClient are notebook 04's:
# this file runs in its namespace.
import asyncio


async def count_aborted(n: int) -> tuple[int, int]:
    control = VLLMControlClient(server.url, api_key=server.api_key)
    async with CompletionsClient.for_server(server, ClientConfig(max_in_flight=n)) as c:
        flying = [asyncio.ensure_future(c.generate(prompt_ids, max_tokens=200, ignore_eos=True))
                  for _ in range(n)]
        # A pause only aborts what is running, and a request that reaches a paused server waits
        # for the resume: wait until the server's own gauge says all n are decoding (in a
        # thread, so this loop goes on sending them). A fixed sleep can outlast 8 short
        # requests on an idle machine, or pause before the last ones were sent on a busy one.
        await asyncio.to_thread(control.wait_running, n, 60.0)
        control.pause("abort")
        try:
            outs = [o for got in await asyncio.gather(*flying) for o in got]
        finally:
            control.resume()  # a paused server would leave every later request waiting
    aborted = sum(o.finish_reason == "abort" for o in outs)
    return aborted, len(outs) - aborted
