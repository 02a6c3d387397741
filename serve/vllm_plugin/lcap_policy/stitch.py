"""Token-in, token-out across the turns of one conversation: the rule, on plain values.

A turn's head is what it leaves for the next turn: its exact ids (prompt + sampled completion), a
digest of each chat message of its request and of the context that shapes the prompt (tools,
template arguments), and a digest of the assistant message it produced, normalised so that the
harness's re-serialisation does not count (whitespace, content null or "", tool-call arguments
re-dumped, reasoning dropped, call ids). A new request extends the head when its first messages
have the head's digests, the assistant message(s) after them match what the model produced, and
more messages follow. Its prompt is then the head's ids, followed by the template's rendering of
what came after the assistant message, cut at the end of that message in the rendered text: the
head ends on one of the model's stop tokens (`stop`) and the template ends every message with a stop
token (the same one, or e.g. <|im_end|> where the model stopped on <|endoftext|>), so the assistant
message ends at the k-th such token of the rendered text, k being one more than those in the head's
prompt. The rendered suffix is tokenized alone: the stop token is an added token, where tokenizers
start afresh.

Nothing here imports vLLM: tests run it on a Hugging Face tokenizer and the templates themselves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

DIGEST_CHARS = 16


@dataclass
class Head:
    ids: list[int]  # the turn's prompt ids then its completion ids, as served
    prompt_len: int
    n: int  # chat messages in the turn's request
    digests: list[str]  # of each of them
    context: str  # digest of the rest of what shapes the prompt (tools, template arguments)
    out: str  # digest of the assistant message the turn produced (normalised)
    stop: int | None  # the completion's last id when it ended on a stop token, else None

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def parse(cls, value: Any) -> Head:
        """A head sent back by the proxy; ValueError when it is not one (a client may send anything)."""
        if not isinstance(value, dict):
            raise ValueError("the head is not an object")
        try:
            head = cls(**{name: value[name] for name in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"the head lacks {exc}") from None
        ids = head.ids
        if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
            raise ValueError("the head's ids are not token ids")
        if not (isinstance(head.prompt_len, int) and 0 < head.prompt_len <= len(ids)):
            raise ValueError("the head's prompt_len is out of range")
        if not (isinstance(head.digests, list) and isinstance(head.n, int) and len(head.digests) == head.n):
            raise ValueError("the head's digests do not match its message count")
        return head


def _as_dict(message: Any) -> dict:
    if isinstance(message, dict):
        return message
    dump = getattr(message, "model_dump", None)
    return dump(exclude_none=True) if dump is not None else dict(message)


def digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else [content]:
        part = _as_dict(part) if not isinstance(part, str) else part
        if isinstance(part, str):
            parts.append(part)
        elif part.get("type") in ("text", "output_text", "input_text"):
            parts.append(part.get("text") or "")
    return "".join(parts)


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return arguments


def assistant_digest(messages: Sequence[Any]) -> str:
    """The digest of one assistant turn (one message, or several in a row) as the model produced it: its text
    with whitespace runs collapsed, and its tool calls' names and parsed arguments. Reasoning, call ids and
    empty-vs-null content do not count: harnesses drop or rewrite them, and the model's own tokens are kept."""
    text: list[str] = []
    calls = []
    for message in messages:
        message = _as_dict(message)
        text.append(_text(message.get("content")))
        for call in message.get("tool_calls") or ():
            call = _as_dict(call)
            function = _as_dict(call.get("function") or {})
            calls.append([function.get("name"), _arguments(function.get("arguments"))])
    return digest([" ".join("".join(text).split()), calls])


def message_digests(messages: Sequence[Any]) -> list[str]:
    """One digest per chat message; assistant messages are normalised as `assistant_digest` says, so a harness
    that re-serialises its history each turn still matches the previous turn's digests."""
    out = []
    for message in messages:
        message = _as_dict(message)
        out.append(assistant_digest([message]) if message.get("role") == "assistant" else digest(message))
    return out


def match(head: Head, messages: Sequence[Any], context: str) -> tuple[int | None, str]:
    """(the index just past the assistant turn that extends `head`, "") or (None, why the request does not)."""
    if head.stop is None:
        return None, "the previous turn did not end on a stop token (cut by the token limit or a stop string)"
    if context != head.context:
        return None, "the tools or template arguments changed since the previous turn"
    n = head.n
    if len(messages) <= n:
        return None, "the request has no messages after the previous turn's"
    if message_digests(messages[:n]) != head.digests:
        return None, "the earlier messages differ from the previous turn's"
    end = n
    while end < len(messages) and _as_dict(messages[end]).get("role") == "assistant":
        end += 1
    if end == n:
        return None, "the message after the previous turn's is not the assistant's"
    if assistant_digest(messages[n:end]) != head.out:
        return None, "the assistant message differs from what the model produced"
    if end == len(messages):
        return None, "nothing follows the assistant message"
    return end, ""


def suffix_text(prefix_text: str, full_text: str, stop_text: str, prompt_stops: int) -> tuple[str | None, str]:
    """The rendered text that follows the assistant turn in `full_text`, given `prefix_text` (the request rendered
    up to and including that turn, without a generation prompt) and the number of stop tokens in the head's
    prompt; (None, why) when the template does not end the turn with the model's stop token."""
    count = prefix_text.count(stop_text)
    if count == 0:
        return None, f"the template does not end an assistant message with {stop_text!r}"
    if count != prompt_stops + 1:
        return None, (
            f"the rendered history has {count} {stop_text!r} up to the assistant message, the previous prompt "
            f"{prompt_stops} + its completion's"
        )
    glue = prefix_text[prefix_text.rfind(stop_text) + len(stop_text) :]
    at = -1
    for _ in range(count):
        at = full_text.find(stop_text, at + 1)
        if at < 0:
            return None, "the full rendering has fewer message ends than its history"
    rest = full_text[at + len(stop_text) :]
    if not rest.startswith(glue):
        return None, "the template writes the end of the assistant message differently when more follows"
    return rest, ""


def stitched_ids(head: Head, suffix_ids: Sequence[int], max_model_len: int) -> tuple[list[int] | None, str]:
    ids = head.ids + list(suffix_ids)
    if not suffix_ids:
        return None, "the rendered suffix is empty"
    if len(ids) >= max_model_len:
        return None, f"the stitched prompt ({len(ids)} tokens) leaves no room under max_model_len {max_model_len}"
    return ids, ""
