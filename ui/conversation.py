"""A captured call as the model saw it: the request's messages per API dialect, and the answer.

Each dialect spells a conversation differently (chat's `messages`, completions' `prompt`, Responses'
`instructions` + `input` items, Anthropic's `system` + content blocks); lcap.capture.turns.conversation reads
them (as build-dataset's re-rendering does), and here they become one shape, `Message`s of `Part`s (text, reasoning, a tool call with its arguments, a tool result), so one
template shows them all. The answer comes from the turn's parsed columns (completion_text,
tool_calls, reasoning), which capture fills the same way for every dialect.

Agents resend the whole history on every call. `conversation` shows, per call, only what is new
since the previous call: the messages after the previous prompt and the previous answer. When a
prompt does not continue the previous one (a template that rewrites history, a compacted context),
the call shows its whole prompt and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lcap.capture import Block, anthropic_entries, content_blocks, responses_entries

MAX_TEXT = 20_000  # characters of one part shown inline; the rest is in the raw request


@dataclass
class Part:
    kind: str  # text | reasoning | tool_call | tool_result | image | data
    text: str = ""
    name: str | None = None  # the tool's name (tool_call, tool_result when known)
    call_id: str | None = None
    hidden: int = 0  # characters left out (over MAX_TEXT)

    def key(self) -> tuple[str, str, str | None]:
        return (self.kind, self.text, self.name)


@dataclass
class Message:
    role: str  # system | developer | user | assistant | tool
    parts: list[Part] = field(default_factory=list)

    def key(self) -> tuple[Any, ...]:
        return (self.role, tuple(p.key() for p in self.parts))


def _part(kind: str, text: Any, **kw: Any) -> Part:
    if not isinstance(text, str):
        text = json.dumps(text, ensure_ascii=False, indent=1) if text is not None else ""
    hidden = max(0, len(text) - MAX_TEXT)
    return Part(kind, text[:MAX_TEXT] if hidden else text, hidden=hidden, **kw)


def pretty(value: Any) -> str:
    """A value (tool-call arguments, reward details) pretty-printed when it is JSON, else as sent."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, indent=1, ensure_ascii=False, default=str)


def _call(arguments: Any, name: Any, call_id: Any) -> Part:
    """A tool call: its arguments pretty-printed."""
    return _part("tool_call", pretty(arguments), name=name, call_id=call_id)


def _text(content: Any) -> str:
    """A tool result's content (a string, or content blocks) as one text."""
    return content if isinstance(content, str) else "\n".join(p.text for p in _content_parts(content))


def _content_parts(content: Any) -> list[Part]:
    """Chat / Responses / Anthropic content: a string or a list of typed blocks (lcap.capture.turns.conversation)."""
    return [_block_part(block) for block in content_blocks(content)]


def _block_part(block: Block) -> Part:
    if block.kind == "text":
        return _part("text", block.text)
    if block.kind == "reasoning":
        return _part("reasoning", block.text)
    if block.kind == "call":
        return _call(block.arguments, block.name, block.call_id)
    if block.kind == "result":
        return _part("tool_result", _text(block.content), call_id=block.call_id)
    if block.kind == "media":
        return Part("image", f"[{block.text}]")
    return _part("data", block.raw)


def _chat(request: dict) -> list[Message]:
    messages = []
    for m in request.get("messages") or ():
        if not isinstance(m, dict):
            continue
        role = str(m.get("role") or "user")
        parts = []
        if thought := m.get("reasoning_content") or m.get("reasoning"):
            parts.append(_part("reasoning", thought))
        if role == "tool":
            parts.append(
                _part("tool_result", _text(m.get("content")), name=m.get("name"), call_id=m.get("tool_call_id"))
            )
        else:
            parts.extend(_content_parts(m.get("content")))
        for call in m.get("tool_calls") or ():
            fn = (call or {}).get("function") or {}
            parts.append(_call(fn.get("arguments"), fn.get("name"), call.get("id")))
        messages.append(Message(role, parts))
    return messages


def _completions(request: dict) -> list[Message]:
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [Message("user", [Part("data", f"[{len(prompt)} prompt token ids]")])]
    if isinstance(prompt, list):
        prompt = "\n".join(str(p) for p in prompt)
    return [Message("prompt", [_part("text", prompt or "")])]


def _responses(request: dict) -> list[Message]:
    messages = []
    for entry in responses_entries(request):
        if entry.kind == "message":
            messages.append(Message(str(entry.role or "user"), _content_parts(entry.content)))
        elif entry.kind == "call":
            messages.append(Message("assistant", [_call(entry.arguments, entry.name, entry.call_id)]))
        elif entry.kind == "result":
            messages.append(Message("tool", [_part("tool_result", _text(entry.content), call_id=entry.call_id)]))
        elif entry.kind == "reasoning":
            messages.append(Message("assistant", [_part("reasoning", entry.text or "[encrypted reasoning]")]))
        elif isinstance(entry.raw, dict):  # an item of a kind not shown otherwise
            messages.append(Message("assistant", [_part("data", entry.raw)]))
    return messages


def _messages(request: dict) -> list[Message]:
    messages = []
    for entry in anthropic_entries(request):
        parts = _content_parts(entry.content)
        role = str(entry.role or "user")
        if role == "user" and parts and all(p.kind == "tool_result" for p in parts):
            role = "tool"
        messages.append(Message(role, parts))
    return messages


_READERS = {"chat": _chat, "completions": _completions, "responses": _responses, "messages": _messages}


def prompt_messages(dialect: str | None, request: Any) -> list[Message]:
    """The request's conversation in the dialect's own terms; unreadable bodies become one data part."""
    if isinstance(request, str):
        try:
            request = json.loads(request)
        except ValueError:
            return [Message("request", [_part("data", request)])]
    if not isinstance(request, dict):
        return [] if request is None else [Message("request", [_part("data", request)])]
    reader = _READERS.get(dialect or "")
    return reader(request) if reader else [Message("request", [_part("data", request)])]


def tool_names(request: Any) -> list[str]:
    """The names of the tools a request offered the model (any dialect)."""
    if isinstance(request, str):
        try:
            request = json.loads(request)
        except ValueError:
            return []
    names = []
    for tool in (request or {}).get("tools") or () if isinstance(request, dict) else ():
        if isinstance(tool, dict):
            names.append(str(tool.get("name") or (tool.get("function") or {}).get("name") or tool.get("type") or "?"))
    return names


def answer_message(turn: dict[str, Any]) -> Message:
    """The model's answer from the turn's parsed columns (the same for every dialect)."""
    parts = []
    if turn.get("reasoning"):
        parts.append(_part("reasoning", turn["reasoning"]))
    if turn.get("completion_text"):
        parts.append(_part("text", turn["completion_text"]))
    calls = turn.get("tool_calls")
    if isinstance(calls, str):
        try:
            calls = json.loads(calls)
        except ValueError:
            calls = [{"name": "?", "arguments": calls}]
    for call in calls or ():
        if isinstance(call, dict):
            parts.append(_call(call.get("arguments"), call.get("name"), call.get("id")))
    return Message("assistant", parts)


@dataclass
class TurnView:
    turn: dict[str, Any]
    new: list[Message]  # what this call's prompt adds to the conversation so far
    answer: Message
    rewritten: bool  # the prompt does not continue the previous call's (history rewritten or a new context)
    echoed: int  # how many earlier messages the prompt repeats (not shown again)
    tools: list[str]


def conversation(turns: list[dict[str, Any]]) -> list[TurnView]:
    """Each call with what its prompt adds to the conversation so far, and its answer."""
    views: list[TurnView] = []
    previous: list[tuple[Any, ...]] | None = None
    for turn in turns:
        prompt = prompt_messages(turn.get("dialect"), turn.get("request"))
        keys = [m.key() for m in prompt]
        answer = answer_message(turn)
        if previous is None:
            new, rewritten, echoed = prompt, False, 0
        elif keys[: len(previous)] == previous:
            new, rewritten, echoed = prompt[len(previous) :], False, len(previous)
            # The agent sends the previous answer back as the next message: shown once, as the answer.
            if new and new[0].role == "assistant" and views and _same_answer(new[0], views[-1].answer):
                new, echoed = new[1:], echoed + 1
        else:
            new, rewritten, echoed = prompt, True, 0
        views.append(TurnView(turn, new, answer, rewritten, echoed, tool_names(turn.get("request"))))
        previous = keys
    return views


def _same_answer(sent: Message, answer: Message) -> bool:
    """Whether a message the agent sent back is the model's previous answer (text and calls, not ids)."""

    def shape(m: Message) -> list[tuple[str, str, str | None]]:
        return [(p.kind, p.text.strip(), p.name) for p in m.parts if p.kind in ("text", "tool_call")]

    return shape(sent) == shape(answer)
