"""A call's role: which of an agent's jobs (a planner, a coder, a sub-agent) made it, stored as `turns.role`.

In order: the `X-Lcap-Role` header (taken out before the upstream, as lcap's other headers are), else the first
`--role-by` rule that matches (`model:NAME=ROLE`: the model the agent asked for is NAME; `system:REGEX=ROLE`: the
call's system prompt matches REGEX, searched anywhere in it), else `default`. A header value that is no role name
is not one: the rules decide (the agent's call goes on either way).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lcap.capture.trust.credentials import HeaderFields
from lcap.config import LcapError
from lcap.policy import DEFAULT_ROLE

ROLE_HEADER = b"x-lcap-role"
ROLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a path segment of a run folder, a LoRA name
RULE_KINDS = ("model", "system")
MAX_SYSTEM_CHARS = 64 * 1024  # of the system prompt a `system:` rule searches: a bound on each call's regex work


@dataclass(frozen=True)
class RoleRule:
    kind: str  # model | system
    pattern: str
    role: str
    regex: re.Pattern[str] | None = None

    def matches(self, request: dict[str, Any]) -> bool:
        if self.kind == "model":
            return request.get("model") == self.pattern
        assert self.regex is not None
        return self.regex.search(system_prompt(request)[:MAX_SYSTEM_CHARS]) is not None


def parse_role_by(rules: tuple[str, ...] | list[str]) -> tuple[RoleRule, ...]:
    """`--role-by` rules, in the order given; a rule lcap cannot read is a one-line error."""
    parsed = []
    for text in rules:
        kind, sep, rest = text.partition(":")
        pattern, eq, role = rest.rpartition("=")
        if not sep or not eq or kind not in RULE_KINDS or not pattern:
            raise LcapError(f"--role-by {text!r}: use model:NAME=ROLE or system:REGEX=ROLE")
        if not ROLE_NAME.fullmatch(role):
            raise LcapError(f"--role-by {text!r}: a role is 1-64 letters, digits, '_', '.' or '-'")
        regex = None
        if kind == "system":
            try:
                regex = re.compile(pattern)
            except re.error as exc:
                raise LcapError(f"--role-by {text!r}: {exc}") from None
        parsed.append(RoleRule(kind, pattern, role, regex))
    return tuple(parsed)


def take_role_header(fields: HeaderFields) -> tuple[str | None, HeaderFields]:
    """(the `X-Lcap-Role` value when it names a role, else None; the fields without the header); `fields` itself
    when it has none."""
    if not any(name.lower() == ROLE_HEADER for name, _ in fields):
        return None, fields
    value = None
    keep = []
    for name, field_value in fields:
        if name.lower() == ROLE_HEADER:
            text = field_value.decode("utf-8", "replace").strip()
            value = text if ROLE_NAME.fullmatch(text) else value
        else:
            keep.append((name, field_value))
    return value, tuple(keep)


def role_of(header: str | None, rules: tuple[RoleRule, ...], request: Any) -> str:
    """The role of a call: its header's, else the first matching rule's, else `default`."""
    if header is not None:
        return header
    if isinstance(request, dict):
        for rule in rules:
            if rule.matches(request):
                return rule.role
    return DEFAULT_ROLE


def system_prompt(request: dict[str, Any]) -> str:
    """The system text of a call in any dialect: Anthropic's `system`, Responses' `instructions`, and the
    system/developer messages of `messages` (Chat Completions) or `input` (Responses), joined by newlines."""
    parts = [_text(request.get("system")), _text(request.get("instructions"))]
    for key in ("messages", "input"):
        items = request.get(key)
        if isinstance(items, list):
            parts += [
                _text(m.get("content"))
                for m in items
                if isinstance(m, dict) and m.get("role") in ("system", "developer")
            ]
    return "\n".join(p for p in parts if p)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: {"type": "text", "text": ...} and its Responses kin
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
