"""Train: the policy server (vLLM), TRL GRPO on captured samples, rounds and redeploys."""
