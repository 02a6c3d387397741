"""Train: TRL GRPO on captured samples, with the off-policy correction against the serving policy."""
