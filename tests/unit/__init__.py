"""Unit tier: in-process tests only (no child process, no inet socket, no vLLM, no browser); the whole tier runs
in about a minute: `.venv/bin/python -m pytest tests/unit`."""
