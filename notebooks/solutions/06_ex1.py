# ruff: noqa: F821
# actors, class_for, Echo and time are notebook 06's: this file runs in its namespace.


async def start_cost(name: str, n: int) -> float:
    api = actors.backend(name)
    t0 = time.perf_counter()
    procs = api.this_host().spawn_procs(per_host={"gpus": n})
    mesh = procs.spawn("echo", class_for(Echo, api))
    # Monarch spawns in the background: the start is over when every actor has answered
    await mesh.echo.call(0)
    elapsed = time.perf_counter() - t0
    await mesh.stop()
    await procs.stop()
    return elapsed
