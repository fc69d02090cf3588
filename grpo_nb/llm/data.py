"""What the LLM ring is fed: the task's prompts rendered for the model, the held-out set, and the
:class:`RingSpec` bundle every actor receives besides the config::

    tasks.load_task(cfg.dataset) ──► train rows ──render_prompt──► [Prompt(text, ids, answer)]
                                └──► test rows  ──render_prompt──► [Prompt, ...] (greedy eval)
    render_prompt: the model's chat template when it has one, else the plain prompt text;
    prompts longer than cfg.max_prompt_len tokens are left out and counted.

All of it is plain data, so it pickles to actors on other processes (Monarch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Prompt(NamedTuple):
    """One problem: the rendered prompt text, its token ids, and the reference answer."""

    text: str
    ids: list[int]
    answer: str


@dataclass
class RingSpec:
    """Everything the actors need besides the config."""

    server_url: str
    model_name: str
    model_dir: str
    prompts: list[Prompt]
    eval_prompts: list[Prompt] = field(default_factory=list)
    run_dir: str | None = None
    resume_dir: str | None = None
    reward_default: str = "exact"  # what reward "auto" means for this task
    api_key: str | None = None


@dataclass
class TaskData:
    """The rendered prompts of a task, and what the summary says about them."""

    train: list[Prompt]
    test: list[Prompt]
    kind: str  # "arithmetic" or "math"
    prompt_example: str  # the first training prompt exactly as the model sees it
    filtered: int  # prompts (train + test) longer than max_prompt_len, left out
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # what the template got


def _render(tokenizer: Any, rows: list[dict[str, Any]], limit: int,
            template_kwargs: dict[str, Any] | None) -> tuple[list[Prompt], int]:
    from grpo_nb.tasks import prompt_text

    texts = [prompt_text(tokenizer, row, chat_template_kwargs=template_kwargs) for row in rows]
    # = tasks.render_prompt, batched (20,000 arithmetic prompts: one call, not 20,000)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    kept, dropped = [], 0
    for text, ids, row in zip(texts, encoded, rows, strict=True):
        if len(ids) > limit:
            dropped += 1
        else:
            kept.append(Prompt(text, list(ids), str(row["answer"])))
    return kept, dropped


def load_data(tokenizer: Any, cfg: Any, smoke: bool) -> TaskData:
    """Load ``cfg.dataset``, render its prompts for ``tokenizer``, drop the too-long ones."""
    from grpo_nb.tasks import ArithmeticTaskConfig, load_task

    task = load_task(cfg.dataset, test_size=cfg.test_size, system_prompt=cfg.system_prompt,
                     arithmetic=ArithmeticTaskConfig.smoke() if smoke else None)
    kwargs = cfg.chat_template_kwargs
    train, dropped_train = _render(tokenizer, task.train.to_list(), cfg.max_prompt_len, kwargs)
    test_rows = task.test.select(range(min(cfg.eval_size, len(task.test)))).to_list()
    test, dropped_test = _render(tokenizer, test_rows, cfg.max_prompt_len, kwargs)
    if not train:
        raise ValueError(f"LLMConfig.max_prompt_len={cfg.max_prompt_len}: every training prompt "
                         f"of {cfg.dataset!r} is longer; raise it")
    from grpo_nb.tasks import has_chat_template, template_defaults

    used = {**template_defaults(tokenizer), **(kwargs or {})} if has_chat_template(tokenizer) \
        else {}
    return TaskData(train, test, task.kind, train[0].text, dropped_train + dropped_test, used)
