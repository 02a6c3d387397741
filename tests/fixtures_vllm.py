"""Fixtures of the vllm tests."""
