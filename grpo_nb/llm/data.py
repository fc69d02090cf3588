"""What the LLM ring carries: rendered prompts, the :class:`Group` of :class:`Rollout` every
stage passes on, and the :class:`RingSpec` each actor gets; plain data, so it pickles (Monarch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from grpo_nb.config import InputError


class Prompt(NamedTuple):
    """One problem: the rendered prompt text, its token ids, and the reference answer."""

    text: str
    ids: list[int]
    answer: str


@dataclass
class Rollout:
    """One sampled completion of its :class:`Group`'s prompt (the group holds the prompt, its
    id and version); the Scorer fills ``reward`` and ``advantage``, the Reference
    ``ref_logprobs`` (only with a KL penalty). ``token_versions``: the weight version that
    sampled each completion token."""

    completion_ids: list[int]
    sampler_logprobs: list[float]
    completion_text: str
    finish_reason: str | None
    reward: float = 0.0
    advantage: float = 0.0
    latency_s: float = 0.0
    ref_logprobs: list[float] | None = None
    token_versions: list[int] = field(default_factory=list)
    masked: bool = False  # out of the loss (the Scorer: a truncated one, overlong="filter")


@dataclass
class Group:
    """``group_size`` rollouts of one prompt, generator to trainer; ``policy_version`` is the
    version of its oldest token (the one staleness and admission read)."""

    group_id: int
    prompt: str
    answer: str
    prompt_ids: list[int]
    rollouts: list[Rollout]
    policy_version: int
    # Wall clock (time.time()), not perf_counter: the ring compares it across processes.
    t_submit: float
    t_done: float
    source: str = ""

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    @property
    def advantages(self) -> list[float]:
        return [r.advantage for r in self.rollouts]

    @property
    def n_tokens(self) -> int:
        return sum(len(r.completion_ids) for r in self.rollouts)


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
    reward_default: str  # what reward "auto" means: tasks.Task.default_reward
    prompt_example: str  # the first training prompt exactly as the model sees it
    filtered: int  # prompts (train + test) longer than max_prompt_len, left out
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # what the template got


def render_prompts(tokenizer: Any, rows: list[dict[str, Any]], limit: int,
                   template_kwargs: dict[str, Any] | None = None) -> tuple[list[Prompt], int]:
    """``rows`` rendered as :func:`grpo_nb.tasks.render_prompt` renders one, leaving out (and
    counting) those longer than ``limit`` tokens."""
    from grpo_nb.tasks import prompt_ids, prompt_text

    texts = [prompt_text(tokenizer, row, chat_template_kwargs=template_kwargs) for row in rows]
    kept = [Prompt(text, prompt_ids(tokenizer, text), str(row["answer"]))
            for text, row in zip(texts, rows, strict=True)]
    return [p for p in kept if len(p.ids) <= limit], sum(len(p.ids) > limit for p in kept)


def load_data(tokenizer: Any, cfg: Any, smoke: bool) -> TaskData:
    """Load ``cfg.dataset``, render its prompts for ``tokenizer``, drop the too-long ones."""
    from grpo_nb.tasks import ArithmeticTaskConfig, has_chat_template, load_task, template_defaults

    task = load_task(cfg.dataset, test_size=cfg.test_size, system_prompt=cfg.system_prompt,
                     arithmetic=ArithmeticTaskConfig.smoke() if smoke else None)
    kwargs = cfg.chat_template_kwargs
    train, dropped_train = render_prompts(tokenizer, task.train.to_list(), cfg.max_prompt_len,
                                          kwargs)
    test_rows = task.test.select(range(min(cfg.eval_size, len(task.test)))).to_list()
    test, dropped_test = render_prompts(tokenizer, test_rows, cfg.max_prompt_len, kwargs)
    if not train:
        raise InputError(f"LLMConfig.max_prompt_len={cfg.max_prompt_len}: every training prompt "
                         f"of {cfg.dataset!r} is longer; raise it")
    used = {**template_defaults(tokenizer), **(kwargs or {})} if has_chat_template(tokenizer) \
        else {}
    return TaskData(train, test, task.kind, task.default_reward, train[0].text,
                    dropped_train + dropped_test, used)
