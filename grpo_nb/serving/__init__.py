"""Serving the policy with vLLM: the server's life cycle, the completions client, and groups of
scored rollouts (notebook 04). The LLM ring (:mod:`grpo_nb.llm`) generates through these."""
