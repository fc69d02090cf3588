"""Prompts with verifiable answers, chosen by configuration: data, rewards, prompt rendering.

GRPO needs a *verifier*, not labels: a function that says how good a completion is. Every task
gives the same three pieces, so that the rollout code never knows which task it serves::

    load_task("arithmetic" | "openai/gsm8k" | "data.jsonl" | "folder/")
        └─► Task(train, test): prompt, messages, answer
                 │                                   │
    render_prompt(tokenizer, row)            task.reward("auto" | "math+0.1*format" | fn)
      chat template when the model has one     └─► reward(completion_text, answer) -> float

* :mod:`~grpo_nb.tasks.arithmetic` — the offline task (``"003+006="`` → ``"0009"``), chat-free
  so that the tiny character model spends no tokens on a template.
* :mod:`~grpo_nb.tasks.data` / :mod:`~grpo_nb.tasks.rows` — files, folders and hub datasets in
  GSM8K, OpenR1-Math or chat ``messages`` format.
* :mod:`~grpo_nb.tasks.answers` / :mod:`~grpo_nb.tasks.rewards` — answer extraction,
  numeric / math-verify comparison, and the reward registry.
* :mod:`~grpo_nb.tasks.prompts` — the chat template (or the plain text) around a row.
"""

from grpo_nb.tasks.answers import answers_match, extract_answer, format_ok
from grpo_nb.tasks.arithmetic import (
    ArithmeticTaskConfig,
    arithmetic_config,
    format_problem,
    is_arithmetic_name,
    make_dataset,
)
from grpo_nb.tasks.data import (
    HUB_INSTRUCTION,
    Task,
    dataset_source,
    load_hub_math,
    load_task,
)
from grpo_nb.tasks.prompts import (
    has_chat_template,
    prompt_text,
    render_prompt,
    template_defaults,
)
from grpo_nb.tasks.rewards import (
    REWARDS,
    RewardFn,
    RewardSpec,
    WeightedReward,
    make_reward,
    parse_reward,
    register_reward,
)

__all__ = [
    "HUB_INSTRUCTION", "REWARDS", "ArithmeticTaskConfig", "RewardFn", "RewardSpec", "Task",
    "WeightedReward", "answers_match", "arithmetic_config", "dataset_source", "extract_answer",
    "format_ok", "format_problem", "has_chat_template", "is_arithmetic_name", "load_hub_math",
    "load_task", "make_dataset", "make_reward", "parse_reward", "prompt_text", "register_reward",
    "render_prompt", "template_defaults",
]
