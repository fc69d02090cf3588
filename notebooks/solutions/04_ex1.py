# ruff: noqa: F821
# client, prompts, cfg and score are notebook 04's (section 4): this file runs in its namespace.
from grpo_nb.llm import rollouts
from grpo_nb.llm.data import Group


async def mixed_at_temperature(t: float) -> tuple[list[Group], float]:
    # Only a mixed group (rewards that differ) has non-zero advantages. Too low a temperature
    # makes a group's samples agree (all right or all wrong); too high makes most samples wrong,
    # and an all-wrong group's rewards are equal too: no learning signal either way.
    groups = await rollouts.sample_groups(client, prompts, cfg.replace(temperature=t),
                                          reward=score)
    mixed = rollouts.summarize(groups, 1.0)["mixed_groups"]
    return groups, mixed / len(groups)
