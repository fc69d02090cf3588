"""Prompts with verifiable answers, chosen by configuration: every task gives rows
(``load_task``), a way to render them (``render_prompt``) and a reward (``make_reward``), so the
rollout code never knows which task it serves.
"""

from grpo_nb.tasks.arithmetic import (
    ArithmeticTaskConfig,
    format_problem,
    is_arithmetic_name,
    make_dataset,
)
from grpo_nb.tasks.data import HUB_INSTRUCTION, Task, check_task_fields, dataset_source, load_task
from grpo_nb.tasks.prompts import (
    has_chat_template,
    prompt_ids,
    prompt_text,
    render_prompt,
    template_defaults,
)
from grpo_nb.tasks.rewards import REWARDS, RewardSpec, extract_answer, make_reward, reward_terms

__all__ = [
    "HUB_INSTRUCTION", "REWARDS", "ArithmeticTaskConfig", "RewardSpec", "Task",
    "check_task_fields", "dataset_source", "extract_answer", "format_problem",
    "has_chat_template", "is_arithmetic_name", "load_task", "make_dataset", "make_reward",
    "prompt_ids", "prompt_text", "render_prompt", "reward_terms", "template_defaults",
]
