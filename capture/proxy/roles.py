"""A call's role: which of an agent's jobs (a planner, a coder, a sub-agent) made it, stored as `turns.role`.

In order: the `X-Lcap-Role` header (taken out before the upstream, as lcap's other headers are), else the first
`--role-by` rule that matches (`model:NAME=ROLE`: the model the agent asked for is NAME; `system:REGEX=ROLE`: the
call's system prompt matches REGEX, searched anywhere in it; `thread`: the first conversation an episode opens is
`main`, any other it opens (a sub-agent's, which starts from its own system prompt and first message) `subagent`),
else `default`. `thread` matches every call, so rules after it are never reached. A header value that is no role
name is not one: the rules decide (the agent's call goes on either way).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lcap.capture.trust.credentials import HeaderFields
from lcap.capture.turns.dialects import thread_key
from lcap.config import LcapError
from lcap.policy import DEFAULT_ROLE

ROLE_HEADER = b"x-lcap-role"
ROLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a path segment of a run folder, a LoRA name
RULE_KINDS = ("model", "system", "thread")
MAIN_ROLE, SUBAGENT_ROLE = "main", "subagent"  # what `--role-by thread` names an episode's first and other threads
MAX_SYSTEM_CHARS = 64 * 1024  # of the system prompt a `system:` rule searches: a bound on each call's regex work


@dataclass(frozen=True)
class RoleRule:
    kind: str  # model | system | thread
    pattern: str
    role: str
    regex: re.Pattern[str] | None = None

    def matches(self, request: dict[str, Any]) -> bool:
        if self.kind == "thread":
            return True
        if self.kind == "model":
            return request.get("model") == self.pattern
        assert self.regex is not None
        return self.regex.search(system_prompt(request)[:MAX_SYSTEM_CHARS]) is not None


def parse_role_by(rules: tuple[str, ...] | list[str]) -> tuple[RoleRule, ...]:
    """`--role-by` rules, in the order given; a rule lcap cannot read is a one-line error."""
    parsed = []
    for text in rules:
        if text == "thread":
            parsed.append(RoleRule("thread", "", MAIN_ROLE))
            continue
        kind, sep, rest = text.partition(":")
        pattern, eq, role = rest.rpartition("=")
        if not sep or not eq or kind not in RULE_KINDS[:2] or not pattern:
            raise LcapError(f"--role-by {text!r}: use model:NAME=ROLE, system:REGEX=ROLE or thread")
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


def role_of(
    header: str | None, rules: tuple[RoleRule, ...], request: Any, first_thread: Callable[[], bool] = lambda: True
) -> str:
    """The role of a call: its header's, else the first matching rule's, else `default`. `first_thread`: whether
    the call is in the first conversation its episode opened (asked only by a `thread` rule)."""
    if header is not None:
        return header
    if isinstance(request, dict):
        for rule in rules:
            if rule.matches(request):
                return rule.role if rule.kind != "thread" or first_thread() else SUBAGENT_ROLE
    return DEFAULT_ROLE


class EpisodeThreads:
    """The first conversation (thread key) each episode opened, for `--role-by thread`. Bounded: past `limit`
    episodes the least recently seen is forgotten (a call of it after that opens its first thread again)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._first: OrderedDict[str | None, int] = OrderedDict()
        self._lock = threading.Lock()

    def is_first(self, episode: str | None, thread: int) -> bool:
        with self._lock:
            first = self._first.setdefault(episode, thread)
            self._first.move_to_end(episode)
            while len(self._first) > self.limit:
                self._first.popitem(last=False)
        return first == thread

    def forget(self, episode: str) -> None:
        with self._lock:
            self._first.pop(episode, None)


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


class Roles:
    """The roles of one proxy's calls: its `--role-by` rules and, for `thread`, each episode's first conversation."""

    def __init__(self, rules: tuple[RoleRule, ...] = (), *, limit: int = 100_000) -> None:
        self.rules = rules
        self.threads = EpisodeThreads(limit)

    def of(self, header: str | None, request: Any, episode: str | None, dialect: str) -> str:
        """A call's role; `header` is its X-Lcap-Role's (`take_role_header`)."""

        def first_thread() -> bool:
            return self.threads.is_first(episode, thread_key(dialect, request)[0])

        return role_of(header, self.rules, request, first_thread)

    def forget(self, episode: str) -> None:
        self.threads.forget(episode)
