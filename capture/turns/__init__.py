"""Turn parsing: the LLM API dialects (chat, completions, Responses, Messages) and the `turns` row a finished call becomes.

May import: lcap's core and capture.trust."""
