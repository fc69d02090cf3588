"""A finished run in one line: :class:`RunResult`, computed from the run's metric rows
(``train()`` returns it and writes ``result.json``; the CLI prints it as JSON)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from grpo_nb.llm.config import LLMConfig
from grpo_nb.metrics import MetricsRecorder


@dataclass
class RunResult:
    """What a run achieved: accuracy, speed, staleness, sync health, faults, chosen defaults."""

    steps: int
    accuracy_before: float
    accuracy_after: float
    wall_s: float
    sync_ms_mean: float
    stale_dropped: int
    weights_verified: bool  # the last sync proved the server serves the last step's weights
    mode: str = ""
    staleness_mean: float = math.nan
    tokens_per_s: float = math.nan
    run_dir: str | None = None
    ratio_mean: float = math.nan  # π_θ / π_old: far from 1 in sync mode means a mismatch
    clip_frac_mean: float = math.nan
    skipped_steps: int = 0
    failed_requests: int = 0
    aborted_groups: int = 0
    score_timeouts: int = 0  # completions scored 0 for a reward past LLMConfig.score_timeout_s
    step_changed_frac: float = math.nan  # ≈ 0 when bf16 updates round away
    entropy_start: float = math.nan
    entropy_end: float = math.nan
    zero_std_frac_mean: float = math.nan
    truncated_frac_mean: float = math.nan
    response_len_mean: float = math.nan
    # per token: trainer version at the update − the version that sampled it (steps' mean, max)
    token_lag_mean: float = math.nan
    token_lag_max: float = math.nan
    mixed_version_frac: float = math.nan  # completions spanning two or more weight versions
    tis_capped_frac_mean: float = math.nan  # tokens whose TIS weight hit tis_cap
    defaults: dict[str, str] = field(default_factory=dict)


def summarize(rec: MetricsRecorder, cfg: LLMConfig, wall_s: float, dropped: int) -> RunResult:
    evals, syncs, steps = rec.rows("eval"), rec.rows("sync"), rec.rows("step")
    defaults, data = dict(cfg.defaults or {}), rec.rows("data")
    given = cfg.chat_template_kwargs or {}
    chosen = {k: v for k, v in (data[0].get("chat_template_kwargs") or {}).items()
              if k not in given} if data else {}
    if chosen:  # the chat-template arguments left to the template
        defaults["chat_template_kwargs"] = f"{chosen} (the model's chat template reads them: " \
                                           "tasks.template_defaults)"
    stale = [s for r in steps for s in r.get("staleness", [])]
    tokens = sum(r.get("tokens", 0) for r in steps)
    last_sync = syncs[-1] if syncs else {}
    last_step = steps[-1]["step"] if steps else 0
    return RunResult(
        steps=last_step,
        accuracy_before=evals[0]["accuracy"] if evals else math.nan,
        accuracy_after=evals[-1]["accuracy"] if evals else math.nan,
        wall_s=round(wall_s, 2),
        sync_ms_mean=round(statistics.fmean(r["ms"] for r in syncs), 1) if syncs else math.nan,
        stale_dropped=dropped,
        weights_verified=bool(last_sync.get("verified")) and last_sync.get("step") == last_step,
        mode=cfg.mode,
        staleness_mean=round(statistics.fmean(stale), 3) if stale else math.nan,
        tokens_per_s=round(tokens / wall_s, 1) if wall_s > 0 else math.nan,
        run_dir=str(rec.run_dir) if rec.run_dir else None,
        ratio_mean=_mean(r.get("ratio_mean") for r in steps),
        clip_frac_mean=_mean(r.get("clip_frac") for r in steps),
        skipped_steps=len(rec.rows("skipped")),
        failed_requests=len(rec.rows("request_failed")),
        aborted_groups=len(rec.rows("aborted")),
        score_timeouts=len(rec.rows("score_timeout")),
        step_changed_frac=_mean(r.get("step_changed_frac") for r in steps),
        entropy_start=_mean(r.get("entropy") for r in steps[:1]),
        entropy_end=_mean(r.get("entropy") for r in steps[-1:]),
        zero_std_frac_mean=_mean(r.get("zero_std_frac") for r in steps),
        truncated_frac_mean=_mean(r.get("truncated_frac") for r in steps),
        response_len_mean=_mean(r.get("response_len") for r in steps),
        token_lag_mean=_mean(r.get("token_lag_mean") for r in steps),
        token_lag_max=max((r["token_lag_max"] for r in steps if "token_lag_max" in r),
                          default=math.nan),
        mixed_version_frac=_mean(r.get("mixed_version_frac") for r in steps),
        tis_capped_frac_mean=_mean(r.get("tis_capped_frac") for r in steps),
        defaults=defaults,
    )


def _mean(values: Iterable[float | None]) -> float:
    xs = [v for v in values if v is not None]
    return round(statistics.fmean(xs), 4) if xs else math.nan
