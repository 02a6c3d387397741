"""Collection: run an unmodified agent on every task through a capture proxy (locally or as Ray tasks), verify each episode, record its reward, and summarise the collect.

May import: lcap's core, lcap.capture and lcap.dataset.judge (a judge verifier's pass after the agents)."""
