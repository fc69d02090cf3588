from grpo_nb.llm.config import LLMConfig


def stale0_config(cfg: LLMConfig) -> LLMConfig:
    # Async as before (cfg.mode), a staleness budget of zero and a short run; nothing else.
    return cfg.replace(max_staleness=0, steps=min(cfg.steps, 10))
