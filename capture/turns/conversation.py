"""A request's conversation, read once per dialect: the entries of a Responses or Anthropic Messages request
(messages, tool calls, tool results, reasoning), in order, and the blocks of a message's content, each as one
neutral shape. The UI shows them (lcap.ui.conversation); build-dataset's re-rendering and `lcap export` turn them into
chat-template messages (lcap.dataset.build.rebuild). Each reader decides what it makes of an entry; neither reads a
dialect's fields. A chat request's `messages` are chat-template messages already: they are read as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_TEXT = ("text", "input_text", "output_text")
_REASONING = ("thinking", "redacted_thinking", "reasoning_text", "summary_text")
_MEDIA = ("image", "image_url", "input_image", "input_audio", "input_file", "document")


@dataclass(frozen=True)
class Block:
    """One block of a message's content."""

    kind: str  # text | reasoning | call | result | media | other
    text: str | None = None  # text and reasoning; a media block's type
    name: Any = None  # call: the tool's name
    call_id: Any = None  # call: its id; result: the call it answers
    arguments: Any = None  # call: its input, as sent
    content: Any = None  # result: its content, as sent
    raw: Any = None  # the block as sent


@dataclass(frozen=True)
class Entry:
    """One entry of a conversation."""

    kind: str  # message | call | result | reasoning | other
    role: Any = None  # message: its role, as sent
    content: Any = None  # message: its content (text or blocks); result: its output; as sent
    text: str | None = None  # reasoning: its text, None where it holds none (encrypted)
    name: Any = None  # call: the tool's name
    call_id: Any = None  # call: its id; result: the call it answers
    arguments: Any = None  # call: its arguments (a function's JSON text, a custom tool's input), as sent
    custom: bool = False  # a custom tool's call or output (Responses), not a function's
    raw: Any = None  # the entry as sent


def content_blocks(content: Any) -> list[Block]:
    """Chat / Responses / Anthropic content: a string (one text block, none if empty) or a list of typed blocks;
    anything else is one `other` block."""
    if content is None:
        return []
    if isinstance(content, str):
        return [Block("text", content)] if content else []
    if not isinstance(content, list):
        return [Block("other", raw=content)]
    return [_block(block) for block in content]


def _block(block: Any) -> Block:
    if isinstance(block, str):
        return Block("text", block, raw=block)
    if not isinstance(block, dict):
        return Block("other", raw=block)
    kind = block.get("type")
    if kind in _TEXT:
        return Block("text", block.get("text") or "", raw=block)
    if kind in _REASONING:
        return Block("reasoning", block.get("thinking") or block.get("text") or "", raw=block)
    if kind == "tool_use":
        return Block("call", name=block.get("name"), call_id=block.get("id"), arguments=block.get("input"), raw=block)
    if kind == "tool_result":
        return Block("result", call_id=block.get("tool_use_id"), content=block.get("content"), raw=block)
    if kind in _MEDIA:
        return Block("media", kind, raw=block)
    return Block("other", raw=block)


def responses_entries(request: dict) -> list[Entry]:
    """A Responses request's `instructions` (a system message) and `input` items; an input that is neither text
    nor a list of items is one `other` entry."""
    entries = []
    instructions = request.get("instructions")
    if isinstance(instructions, str) and instructions:
        entries.append(Entry("message", role="system", content=instructions))
    given = request.get("input")
    if isinstance(given, str):
        return [*entries, Entry("message", role="user", content=given)]
    if given is not None and not isinstance(given, list):
        return [*entries, Entry("other", raw=given)]
    for item in given or ():
        entries.append(_item(item))
    return entries


def _item(item: Any) -> Entry:
    if not isinstance(item, dict):
        return Entry("other", raw=item)
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        return Entry("message", role=item.get("role"), content=item.get("content"), raw=item)
    if kind in ("function_call", "custom_tool_call"):
        custom = kind == "custom_tool_call"
        return Entry(
            "call",
            name=item.get("name"),
            call_id=item.get("call_id") or item.get("id"),
            arguments=item.get("input") if custom else item.get("arguments"),
            custom=custom,
            raw=item,
        )
    if kind in ("function_call_output", "custom_tool_call_output"):
        custom = kind == "custom_tool_call_output"
        return Entry("result", call_id=item.get("call_id"), content=item.get("output"), custom=custom, raw=item)
    if kind == "reasoning":
        parts = [*(item.get("summary") or ()), *(item.get("content") or ())]
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return Entry("reasoning", text="\n".join(texts) or None, raw=item)
    return Entry("other", raw=item)


def anthropic_entries(request: dict) -> list[Entry]:
    """An Anthropic Messages request's `system` (a system message) and `messages`."""
    entries = []
    if system := request.get("system"):
        entries.append(Entry("message", role="system", content=system))
    for message in request.get("messages") or ():
        if isinstance(message, dict):
            entries.append(Entry("message", role=message.get("role"), content=message.get("content"), raw=message))
    return entries
