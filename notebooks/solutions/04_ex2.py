# ruff: noqa: F821
# client, prompts and cfg are notebook 04's (section 4): this file runs in its namespace.
from grpo_nb import tasks
from grpo_nb.llm import rollouts
from grpo_nb.llm.data import Group


async def bonus_groups() -> list[Group]:
    # Any bare number earns the 0.2, right or wrong: a policy can collect it without ever
    # getting an answer right, so the bonus must stay small beside the answer's 1.0.
    return await rollouts.sample_groups(client, prompts[:4], cfg,
                                        reward=tasks.make_reward("math+0.2*format"))


def never_right(answer: str) -> str:
    # A bare number one off the answer: the math term pays nothing, the format term its 0.2
    # for the shape alone. A policy that answers every prompt this way is paid 0.2 a sample.
    return str(int(answer) + 1)
