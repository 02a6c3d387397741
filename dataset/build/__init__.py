"""Building: captured turns and rewards -> GRPO samples (the multi-turn merge, re-tokenising, the loss report), `--where` selections, `lcap export`, and the one definition of `samples.parquet`.

May import: lcap's core and lcap.capture."""
