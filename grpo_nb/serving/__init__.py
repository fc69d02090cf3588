"""Serving the policy with vLLM: the server's life cycle (its whole process tree) and the
completions client through which the LLM ring (:mod:`grpo_nb.llm`) samples."""
