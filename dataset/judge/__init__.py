"""LLM judges: rewards for agents that have no programmatic verifier (`--verifier judge:RUBRIC.md`).

`prompt.py` renders an episode's transcript as quoted data and builds the judge's prompts (one episode, or a
GRPO group in one call: RULER's relative scoring) with the JSON schema their answer must follow, and parses an
answer without ever raising; `plan.py` says what fits the judge's context and runs the tournament of pairs a group
too long for one call gets; `client.py` calls an OpenAI-compatible endpoint through a capture proxy, so every
judge call is an episode of its own (label `role=judge`); `run.py` judges a set of stored episodes: the cache,
groups, bounded concurrency, rewards and `judge_error` flags.

The judge runs in the dataset stage, as a pass over stored episodes after the agents ran (collect, the loop's
collect, rescore), never inside the proxy: a group is judged once all its samples are stored, and the proxy's
process holds no judge state. Imports: core, capture, `lcap.dataset.build` (transcripts), `lcap.dataset.options`.
"""
