"""Dataset: episodes, verifier rewards, LLM judges (`judge/`), cleaning, GRPO samples."""
