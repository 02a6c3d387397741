"""The proxy path: the front (lcap's own listener and its HTTP/1.1 short path), the embedded mitmproxy and its addon and guards, and `Calls`, what both do with one LLM call.

May import: lcap's core and the other capture sub-packages (turns, routing, storage, reach, trust)."""
