from dataclasses import replace

from grpo_nb.toy.task import ToyConfig


def on_policy_config(cfg: ToyConfig) -> ToyConfig:
    # Both sources of staleness off: "sync" issues the next step's credits only after the
    # update (no run-ahead), and one generator receives every update (no dispatch lag).
    # selection="all" with any number of generators would do as well.
    return replace(cfg, generators=1, mode="sync")
