from grpo_nb.metrics import MetricsRecorder


def staleness_by_generator(r: MetricsRecorder) -> dict:
    # Pool every consumed group's staleness by its generator, then average per generator
    # (not per step: a step holds groups from several generators).
    totals: dict = {}
    for row in r.rows("step"):
        for src, s in zip(row["sources"], row["staleness"], strict=True):
            totals.setdefault(src, []).append(s)
    return {src: sum(v) / len(v) for src, v in sorted(totals.items())}
