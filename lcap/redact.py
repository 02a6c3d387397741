"""Keep secrets out of the store: one redaction for every text lcap keeps or shows.

Headers are not stored at all. Bodies, paths and error texts go through `redact_*` before capture's writer stores
them; the agent's command line, its cwd and the episode's labels go through `redact_text` / `redact_labels` in
`Store.start_episode`, the one way an episode's row is made. Fields and assignments named like credentials
(`api_key`, `CODEX_API_KEY=`, `--api-key VALUE`, `DB_PASSWORD=`) lose their values, and anything shaped like a
well-known API key or bearer token is replaced wherever it appears.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

REDACTED = "[REDACTED]"

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
# Key formats, each replaced wherever it appears (prompts, answers, tool calls, paths, errors). Formats follow the
# issuers' documented token shapes, as the maintained detectors encode them (Yelp's detect-secrets plugins: AWS,
# GitHub, GitLab, Slack, Stripe, JWT, private keys, PyPI, npm, SendGrid, Square, Azure, basic auth; gitleaks' rules
# for Hugging Face, Google, fine-grained GitHub and Anthropic keys); tests/unit/test_capture_secrets.py and tests/integration/test_capture_secrets.py checks redacted
# text with detect-secrets itself. Each rule: (literals that every match contains, how many characters before the
# literal a match may start, the pattern); a `keep` group is a prefix that stays (`aws_secret_access_key = `).
# A rule is tried only where one of its literals occurs (bytes.find over the UTF-8 text, far cheaper than one regex).
_B = r"(?<![A-Za-z0-9_\-])"  # not inside a longer token ("risk-free-2024..." holds no sk- key)
_RULES: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("sk-",), 0, _B + r"sk-(?=[A-Za-z_\-]*[0-9])[A-Za-z0-9_\-]{20,}"),  # OpenAI, Anthropic
    (("hf_",), 0, _B + r"hf_[A-Za-z0-9]{30,}"),  # Hugging Face
    (
        ("A3T", "AKIA", "ASIA", "ABIA", "ACCA"),
        0,
        _B + r"(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16}(?![A-Za-z0-9])",
    ),
    (
        ("aws", "AWS", "Aws"),  # an AWS secret key, recognised by what names it
        0,
        r"(?P<keep>(?i:aws.{0,20}?(?:secret|key|token|pass).{0,20}?)[\"'=:\s]{1,4})[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])",
    ),
    (
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
        0,
        _B + r"(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_\w{22,})",
    ),
    (("gl",), 0, _B + r"gl(?:pat|dt|ft|soat|rt|cbt|imt|ptt|agent|oas)-[A-Za-z0-9_\-]{20,}"),  # GitLab
    (("xox", "xapp-"), 0, _B + r"(?:xox[abposre]-[A-Za-z0-9\-]{10,}|xapp-[0-9]-[A-Za-z0-9\-]{10,})"),  # Slack
    (("hooks.slack.com",), 8, r"https://hooks\.slack\.com/services/[A-Za-z0-9_/]{20,}"),
    (("AIza",), 0, _B + r"AIza[0-9A-Za-z_\-]{35}"),  # Google
    (("k_live_", "k_test_"), 1, _B + r"[sr]k_(?:live|test)_[0-9a-zA-Z]{20,}"),  # Stripe
    (("eyJ",), 0, _B + r"eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"),  # JWT
    (  # a whole private key block (in JSON text its newlines are the two characters \n), or a cut one's body
        ("-----BEGIN",),
        0,
        r"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----(?:[\s\S]{0,16384}?-----END[A-Z0-9 ]{0,40}"
        r"PRIVATE KEY(?: BLOCK)?-----|(?:[A-Za-z0-9+/=\s:-]|\\[rn])*)",
    ),
    (("pypi-",), 0, r"pypi-AgE[A-Za-z0-9_\-]{50,}"),
    (("npm_",), 0, _B + r"npm_[A-Za-z0-9]{36}"),
    (("SG.",), 0, r"SG\.[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}"),  # SendGrid
    (("sq0csp-",), 0, r"sq0csp-[0-9A-Za-z_\-]{43}"),  # Square
    (("AccountKey=",), 0, r"AccountKey=[A-Za-z0-9+/=]{88}"),  # Azure storage
    (("Bearer",), 0, r"Bearer\s+[A-Za-z0-9._\-~+/]{8,}=*"),
    (("://",), 0, r"(?P<keep>://[^:/?#\[\]@!$&'()*+,;=\s\\\"]{1,256}:)[^:/?#\[\]@!$&'()*+,;=\s\\\"]{1,256}(?=@)"),
)
_TRIGGERS = tuple(
    (literal.encode(), back, re.compile(rule.encode())) for literals, back, rule in _RULES for literal in literals
)
_REDACTED = REDACTED.encode()


def _secret_spans(text: bytes) -> list[tuple[int, int]]:
    """(start, end) of each key in `text`, sorted, overlapping ones merged."""
    spans = []
    for literal, back, rule in _TRIGGERS:
        at = text.find(literal)
        while at != -1:
            for start in range(max(0, at - back), at + 1):
                if match := rule.match(text, start):
                    keep = match.groupdict().get("keep")
                    spans.append((match.start() + (len(keep) if keep else 0), match.end()))
                    break
            at = text.find(literal, at + 1)
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _is_secret_key(key: str) -> bool:
    """Whether a field's name says its value is a credential. Names of a usual length are cached: the cache then
    holds at most 4096 short strings, whatever keys an agent's bodies hold."""
    return _secret_name(key) if len(key) <= 64 else _secret_name.__wrapped__(key)


@functools.lru_cache(maxsize=4096)
def _secret_name(key: str) -> bool:
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
    """Text with key-shaped strings replaced (used on prompts and answers: nothing else changes)."""
    if not text:
        return text
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate stays one
    spans = _secret_spans(data)
    if not spans:
        return text
    parts: list[bytes] = []
    last = 0
    for start, end in spans:
        parts += (data[last:start], _REDACTED)
        last = end
    parts.append(data[last:])
    return b"".join(parts).decode("utf-8", "surrogatepass")


# A name that says its value is a credential: a part of its own that is one (CODEX_API_KEY, --api-key, x-auth-token,
# db.secret), a camelCase one (apiKey, accessToken) or anything holding "password". `max_tokens` and `monkey` are not.
_SECRET_NAME = r"""(?:
      (?:[\w.\-]*?[_.\-])?(?:key|token|secret|credentials?|auth)
    | [\w.\-]*?(?:apikey|accesskey|secretkey|privatekey|accesstoken|authtoken|sessiontoken|refreshtoken|clientsecret)
    | [\w.\-]*?passw(?:or)?d[\w.\-]*?)"""
# Its value: a quoted string, or a word up to a space, a quote, `&` (a query string) or `;` (a shell's next command).
_VALUE = r"""(?P<value>"(?:[^"\\\n]|\\.)*"|'[^'\n]*'|[^&;\s'"]+)"""
_SECRET_ASSIGNMENT = re.compile(
    rf"""(?ix)(?<![\w.\-])(?P<name>-{{0,2}}{_SECRET_NAME})
    (?P<sep>["']?[ \t]*=[ \t]*|["']?[ \t]*:[ \t]*(?=[^\s&;'"]{{6}}|["'][^"'\n]{{6}}))  # NAME=VALUE, NAME: VALUE
    {_VALUE}"""
)
_SECRET_FLAG = re.compile(rf"""(?ix)(?<![\w.\-])(?P<name>-{{1,2}}{_SECRET_NAME})(?P<sep>[ \t]+)(?=[^\s-]){_VALUE}""")


def _blank_value(match: re.Match[str]) -> str:
    value = match["value"]
    quote = value[0] if value[0] in "\"'" else ""
    return f"{match['name']}{match['sep']}{quote}{REDACTED}{quote}"


def redact_text(text: str | None) -> str | None:
    """Text with key-shaped strings and the values of credential-named assignments and flags replaced (commands and
    their `env NAME=VALUE`s, `--api-key VALUE`, labels, cwds, errors)."""
    if not text:
        return text
    text = redact_keys(text) or text
    return _SECRET_FLAG.sub(_blank_value, _SECRET_ASSIGNMENT.sub(_blank_value, text))


def redact_labels(labels: Mapping[str, Any]) -> dict[str, Any]:
    """Labels with every name and text value redacted as text, and the whole value of a credential-named label
    blanked."""
    return {
        redact_text(name) or name: REDACTED
        if _SECRET_LABEL.fullmatch(name)
        else (redact_text(value) or value if isinstance(value, str) else value)
        for name, value in labels.items()
    }


_SECRET_LABEL = re.compile(rf"(?ix){_SECRET_NAME}")


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
