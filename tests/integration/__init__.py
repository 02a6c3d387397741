"""Integration tier: lcap's parts as processes and servers (proxies, writers, the UI, agents, a stand-in LLM, a
browser), without vLLM, training or a Ray cluster."""
