"""Orchestration: `lcap loop` (collect -> build-dataset -> train -> deploy, resumable) and `lcap demo`."""
