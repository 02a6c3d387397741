"""Credential headers: what the proxy strips from a request it reroutes to another host.

What is stored goes through core's redaction (`lcap.redact`), one rule for every text lcap keeps.
"""

from __future__ import annotations

# Header names that carry credentials; stripped from requests lcap reroutes to another host.
CREDENTIAL_HEADERS = frozenset(
    (
        "authorization",
        "x-api-key",
        "api-key",
        "cookie",
        "proxy-authorization",
        "x-goog-api-key",
        "openai-organization",
        "openai-project",
    )
)
