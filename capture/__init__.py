"""Capture: an embedded mitmproxy that logs every LLM call of an unmodified agent as a turn."""
