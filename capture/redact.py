"""Keep secrets out of the store: credentials never leave the request path.

Headers are not stored at all. Bodies, paths and error texts go through `redact_*` before they
are written: fields named like credentials lose their values, and anything shaped like a
well-known API key or bearer token is replaced wherever it appears.
"""

from __future__ import annotations

import functools
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode

REDACTED = "[REDACTED]"

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

_SECRET_KEYS = {
    "apikey",
    "xapikey",
    "key",
    "authorization",
    "password",
    "passwd",
    "secret",
    "clientsecret",
    "accesstoken",
    "refreshtoken",
    "idtoken",
    "sessiontoken",
    "token",
    "bearer",
    "cookie",
    "credentials",
    "privatekey",
}
_SECRET_QUERY_KEYS = _SECRET_KEYS | {"sig", "signature", "code", "auth"}
_SECRET_VALUE = re.compile(
    r"(?:sk-(?:ant-|proj-)?[A-Za-z0-9_\-]{12,}|Bearer\s+[A-Za-z0-9._\-~+/]{8,}=*"
    r"|AIza[0-9A-Za-z_\-]{20,}|xox[abp]-[0-9A-Za-z\-]{10,}|gh[pousr]_[A-Za-z0-9]{20,})"
)


_MARKERS = ("sk-", "Bearer", "bearer", "AIza", "xoxa-", "xoxb-", "xoxp-", "ghp_", "gho_", "ghu_", "ghs_", "ghr_")


@functools.lru_cache(maxsize=4096)
def _is_secret_key(key: str) -> bool:
    norm = re.sub(r"[^a-z]", "", key.lower())
    return norm in _SECRET_KEYS or norm.endswith("apikey") or norm.endswith("secret")


def redact_json(value: Any) -> Any:
    """A copy of a JSON value with the values of credential-named fields blanked.

    Key-shaped strings inside values are replaced later, in one pass over the serialized text
    (`redact_keys`): far cheaper than a regex per string.
    """
    if isinstance(value, dict):
        return {k: (REDACTED if isinstance(v, str) and _is_secret_key(k) else redact_json(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_json(v) for v in value]
    return value


def redact_keys(text: str | None) -> str | None:
    """Text with API-key-shaped strings replaced (used on prompts and answers: nothing else changes)."""
    if not text or not any(marker in text for marker in _MARKERS):
        return text
    return _SECRET_VALUE.sub(REDACTED, text)


_SECRET_ASSIGNMENT = re.compile(
    r"""(?i)\b((?:x-)?api[_-]?key|access[_-]?token|secret|password|token)(["']?\s*[=:]\s*["']?)([^&\s'"]{6,})"""
)


def redact_text(text: str | None) -> str | None:
    """Text with key-shaped strings and `api_key=...`-style assignments replaced (commands, errors)."""
    if not text:
        return text
    text = _SECRET_VALUE.sub(REDACTED, text)
    return _SECRET_ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def redact_path(path: str) -> str:
    """The path with the values of credential-like query parameters removed."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    pairs = [
        (k, REDACTED if _is_secret_key(k) or re.sub(r"[^a-z]", "", k.lower()) in _SECRET_QUERY_KEYS else redact_text(v))
        for k, v in parse_qsl(query, keep_blank_values=True)
    ]
    try:
        return f"{base}?{urlencode(pairs, safe='[]', errors='surrogateescape')}"  # a raw byte stays that byte
    except UnicodeEncodeError:  # a lone surrogate that no byte decoded to
        return f"{base}?{urlencode(pairs, safe='[]', errors='surrogatepass')}"
