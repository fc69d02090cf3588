def admit(step: int, group_version: int, max_staleness: int) -> bool:
    # Staleness: how many versions the group's weights are behind the trainer's (never < 0:
    # the server only ever serves weights the trainer already had). The bound itself is allowed.
    return step - group_version <= max_staleness


def issued(received: int, mode: str, max_ahead: int, prompts_per_step: int) -> int:
    # Every group received (dropped ones too) is paid for; beyond them the generators may be
    # working on this step's groups, plus max_ahead steps' worth in async mode only.
    ahead = max_ahead if mode == "async" else 0
    return received + (1 + ahead) * prompts_per_step
