"""The LLM GRPO ring: the toy ring's skeleton (:mod:`grpo_nb.ring`) driving a Qwen-family model
served by vLLM, with weights synced into the running server (notebook 05)."""
