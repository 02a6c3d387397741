"""Serve: the policy on vLLM (LoRA hot-loading), its record, deploys, and the tiny model lcap makes."""
