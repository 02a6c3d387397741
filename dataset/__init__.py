"""Dataset: episodes, verifier rewards, cleaning, GRPO samples."""
