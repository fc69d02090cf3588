"""The toy GRPO ring: an MLP policy learning a contextual bandit with a known optimum
(:mod:`.task`), its four stages (:mod:`.actors`) and their controller (:mod:`.run`)."""
