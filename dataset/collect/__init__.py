"""Collection: run an unmodified agent on every task through a capture proxy (locally or as Ray tasks), verify each episode, record its reward, and summarise the collect.

May import: lcap's core and lcap.capture."""
