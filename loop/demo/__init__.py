"""`lcap demo`: the loop on a bundled agent, task set and verifier (the single-call `number` task and the multi-turn `tools` task), with the tiny model's warm start.

May import: everything below the loop (core, capture, dataset, train, serve) and lcap.loop."""
