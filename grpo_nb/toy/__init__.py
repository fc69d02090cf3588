"""The toy GRPO ring: an MLP policy learning a contextual bandit with a known optimum.

- :mod:`.task` — the task, the policy and :class:`~.task.Group`, the ring's one message;
- :mod:`.actors` — Generator, Scorer, Reference, Trainer on :mod:`grpo_nb.ring`'s skeleton;
- :mod:`.run` — ``run_ring(cfg)`` (the controller) and ``python -m grpo_nb toy``.
"""
