"""LLM API dialects: recognise a call by method and path, and turn its exchange into one turn.

Each dialect knows three things: how to spot its calls (`match`), how to ask vLLM for the exact
token ids it served (`ask_token_ids`), and how to read an answer, streamed or not, into the
fields of a turn (`assemble`). Streams are reassembled into the dialect's non-streaming shape,
so a streamed turn and a plain one look the same in the store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "chat", "completions", "responses", "messages"
TOKEN_ID_DIALECTS = frozenset((CHAT, COMPLETIONS, RESPONSES))  # vLLM returns token ids for these
PER_CALL_SYSTEM_BLOCK = "x-anthropic-billing-header:"  # how Claude Code's per-call system block starts


def match(method: str, path: str) -> str | None:
    """The dialect of a request, from its method and path (query string ignored), on any host."""
    if method != "POST":
        return None
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return CHAT
    if path.endswith("/completions"):
        return COMPLETIONS
    if path.endswith("/responses"):
        return RESPONSES
    if path.endswith("/messages"):
        return MESSAGES
    return None


def looks_like_call(dialect: str, body: Any) -> bool:
    """Body shape check, so that a side call that happens to share a path is not taken for a turn."""
    if not isinstance(body, dict):
        return False
    key = {CHAT: "messages", COMPLETIONS: "prompt", RESPONSES: "input", MESSAGES: "messages"}[dialect]
    return key in body or (dialect == RESPONSES and "previous_response_id" in body)


def thread_key(dialect: str, body: dict) -> tuple[int, int]:
    """(key, messages) of a call: which conversation it belongs to within its episode (a digest of what starts
    it: system prompt and first message, prompt-cache marks left out), and how many messages it carries.
    Stitching offers a call the head its conversation left (capture/routing/stitching.py)."""
    items: list[Any]
    if dialect == RESPONSES:
        given = body.get("input")
        items = given if isinstance(given, list) else [given]
        start: Any = [body.get("instructions"), items[:1]]
    else:
        given = body.get("messages")
        items = given if isinstance(given, list) else []
        start = _uncached([_conversation_system(body.get("system")), items[:1]]) if dialect == MESSAGES else items[:1]
    return hash(json.dumps(start, sort_keys=True, ensure_ascii=False, default=str)), len(items)


def _conversation_system(system: Any) -> Any:
    """A Messages system prompt without the blocks that name the call rather than its conversation: Claude Code
    opens every call's system prompt with its own `x-anthropic-billing-header: ...; cch=HASH; cc_turn_index=N;`
    block, so with it each call of one conversation would key a conversation of its own."""
    if not isinstance(system, list):
        return system
    return [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(PER_CALL_SYSTEM_BLOCK))]


def _uncached(value: Any) -> Any:
    """`value` without Anthropic's `cache_control` marks, which harnesses move from message to message."""
    if isinstance(value, dict):
        return {k: _uncached(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_uncached(v) for v in value]
    return value


# --- asking vLLM for token ids -------------------------------------------------------------------


@dataclass
class Added:
    """What lcap added to a request, so it can be removed from the answer the agent gets."""

    token_ids: bool = False
    logprobs: bool = False
    response_messages: bool = False


def ask_token_ids(dialect: str, body: dict) -> Added | None:
    """Add vLLM's token-id fields to a request; None when the dialect cannot return ids."""
    if dialect not in TOKEN_ID_DIALECTS:
        return None
    added = Added()
    if dialect == RESPONSES:
        if not body.get("enable_response_messages"):
            body["enable_response_messages"] = True
            added.response_messages = True
        return added
    if not body.get("return_token_ids"):
        body["return_token_ids"] = True
        added.token_ids = True
    if dialect == CHAT and not body.get("logprobs"):
        body["logprobs"] = True
        added.logprobs = True
    if dialect == COMPLETIONS and body.get("logprobs") is None:
        body["logprobs"] = 0
        added.logprobs = True
    return added


def strip_added(obj: Any, added: Added) -> Any:
    """Remove from one answer object (or stream chunk) what lcap asked for and the agent did not."""
    if not isinstance(obj, dict):
        return obj
    if added.token_ids:
        obj.pop("prompt_token_ids", None)
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
    if added.logprobs:
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict) and "logprobs" in choice:
                choice["logprobs"] = None
    if added.response_messages:
        for target in (obj, obj.get("response")):
            if isinstance(target, dict):
                target.pop("input_messages", None)
                target.pop("output_messages", None)
    return obj


# --- reading answers ------------------------------------------------------------------------------


@dataclass
class Turn:
    """The dialect-independent fields of one exchange."""

    response: Any = None
    model_served: str | None = None
    text: str | None = None
    tool_calls: list[dict] | None = None
    reasoning: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    error: str | None = None


def sse_events(raw: bytes) -> list[Any]:
    """Parse an SSE body into its `data:` payloads (JSON where possible), `[DONE]` dropped."""
    events: list[Any] = []
    text = raw.decode("utf-8", "replace").replace("\r\n", "\n")
    for block in text.split("\n\n"):
        data = [line[5:].lstrip(" ") if line.startswith("data:") else None for line in block.split("\n")]
        payload = "\n".join(d for d in data if d is not None)
        if not payload or payload == "[DONE]":
            continue
        try:
            events.append(json.loads(payload))
        except ValueError:
            continue
    return events


def assemble(dialect: str, body: bytes, streamed: bool) -> Turn:
    """Read an answer body (JSON, or the whole SSE stream) into a Turn."""
    if streamed:
        return assemble_events(dialect, sse_events(body))
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        return Turn(response=None, error="response is not JSON")
    return assemble_object(dialect, obj)


def assemble_object(dialect: str, obj: Any) -> Turn:
    if not isinstance(obj, dict):
        return Turn(response=obj)
    if "error" in obj and not obj.get("choices") and not obj.get("output") and not obj.get("content"):
        return Turn(response=obj, error=_error_text(obj))
    return {CHAT: _chat, COMPLETIONS: _completions, RESPONSES: _responses, MESSAGES: _messages}[dialect](obj)


def assemble_events(dialect: str, events: list[Any]) -> Turn:
    return {
        CHAT: _chat_stream,
        COMPLETIONS: _completions_stream,
        RESPONSES: _responses_stream,
        MESSAGES: _messages_stream,
    }[dialect](events)


def _error_text(obj: dict) -> str:
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or json.dumps(err))
    return str(err)


def _first_choice(obj: dict) -> dict:
    choices = obj.get("choices") or [{}]
    return choices[0] if isinstance(choices[0], dict) else {}


def _floats(items: Any, key: str = "logprob") -> list[float] | None:
    if not items:
        return None
    return [float(item[key]) if isinstance(item, dict) else float(item) for item in items if item is not None]


def _chat(obj: dict) -> Turn:
    choice = _first_choice(obj)
    msg = choice.get("message") or {}
    calls = [
        {
            "id": c.get("id"),
            "name": (c.get("function") or {}).get("name"),
            "arguments": (c.get("function") or {}).get("arguments"),
        }
        for c in msg.get("tool_calls") or ()
    ]
    usage = obj.get("usage") or {}
    logprobs = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    return Turn(
        response=obj,
        model_served=obj.get("model"),
        text=msg.get("content"),
        tool_calls=calls or None,
        reasoning=msg.get("reasoning_content") or msg.get("reasoning"),
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        prompt_token_ids=obj.get("prompt_token_ids") or choice.get("prompt_token_ids"),
        completion_token_ids=choice.get("token_ids"),
        completion_logprobs=_floats(logprobs),
    )


def _chat_stream(events: list[Any]) -> Turn:
    head: dict = {}
    text: list[str] = []
    reasoning: list[str] = []
    token_ids: list[int] = []
    logprobs: list[Any] = []
    prompt_ids = None
    calls: dict[int, dict] = {}
    finish = usage = None
    role = "assistant"
    for ev in events:
        if not isinstance(ev, dict):
            continue
        if not head and ev.get("id"):
            head = {k: ev.get(k) for k in ("id", "created", "model", "system_fingerprint")}
        usage = ev.get("usage") or usage
        prompt_ids = ev.get("prompt_token_ids") or prompt_ids
        for choice in ev.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            role = delta.get("role") or role
            if delta.get("content"):
                text.append(delta["content"])
            if thought := delta.get("reasoning_content") or delta.get("reasoning"):
                reasoning.append(thought)
            for tc in delta.get("tool_calls") or ():
                slot = calls.setdefault(
                    tc.get("index", len(calls)),
                    {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
                )
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] = fn.get("name") or slot["function"]["name"]
                slot["function"]["arguments"] += fn.get("arguments") or ""
            token_ids.extend(choice.get("token_ids") or ())
            prompt_ids = choice.get("prompt_token_ids") or prompt_ids
            if isinstance(choice.get("logprobs"), dict):
                logprobs.extend(choice["logprobs"].get("content") or ())
            finish = choice.get("finish_reason") or finish
    message: dict[str, Any] = {"role": role, "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    response = {
        **head,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    }
    turn = _chat(response)
    turn.prompt_token_ids = prompt_ids
    turn.completion_token_ids = token_ids or None
    turn.completion_logprobs = _floats(logprobs)
    if finish is None:
        turn.error = "stream ended without a finish_reason"
    return turn


def _completions(obj: dict) -> Turn:
    choice = _first_choice(obj)
    usage = obj.get("usage") or {}
    lp = choice.get("logprobs")
    return Turn(
        response=obj,
        model_served=obj.get("model"),
        text=choice.get("text"),
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        prompt_token_ids=choice.get("prompt_token_ids") or obj.get("prompt_token_ids"),
        completion_token_ids=choice.get("token_ids"),
        completion_logprobs=_floats(lp.get("token_logprobs")) if isinstance(lp, dict) else None,
    )


def _completions_stream(events: list[Any]) -> Turn:
    head: dict = {}
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[Any] = []
    prompt_ids = None
    finish = usage = None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        if not head and ev.get("id"):
            head = {k: ev.get(k) for k in ("id", "created", "model")}
        usage = ev.get("usage") or usage
        for choice in ev.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            text.append(choice.get("text") or "")
            token_ids.extend(choice.get("token_ids") or ())
            prompt_ids = choice.get("prompt_token_ids") or prompt_ids
            if isinstance(choice.get("logprobs"), dict):
                logprobs.extend(choice["logprobs"].get("token_logprobs") or ())
            finish = choice.get("finish_reason") or finish
    response = {
        **head,
        "object": "text_completion",
        "choices": [{"index": 0, "text": "".join(text), "finish_reason": finish}],
        "usage": usage,
    }
    turn = _completions(response)
    turn.prompt_token_ids, turn.completion_token_ids = prompt_ids, token_ids or None
    turn.completion_logprobs = _floats(logprobs)
    if finish is None:
        turn.error = "stream ended without a finish_reason"
    return turn


def _responses(obj: dict) -> Turn:
    content = _Content()
    for item in obj.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            parts = item.get("content") or ()
            content.text.extend(p.get("text") or "" for p in parts if p.get("type") == "output_text")
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "name": item.get("name"), "arguments": item.get("arguments")}
            content.calls.append(call)
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            content.reasoning.extend(p.get("text") or "" for p in parts)
    status = obj.get("status")
    finish = (obj.get("incomplete_details") or {}).get("reason") if status == "incomplete" else status
    ids_in = [t for m in obj.get("input_messages") or () for t in (m.get("tokens") or ())]
    ids_out = [t for m in obj.get("output_messages") or () for t in (m.get("tokens") or ())]
    return content.turn(
        obj,
        finish_reason=finish,
        prompt_token_ids=ids_in or None,
        completion_token_ids=ids_out or None,
        error=_error_text(obj) if obj.get("error") else None,
    )


@dataclass
class _Content:
    """A Responses or Messages answer's content, gathered from its items or blocks."""

    text: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)

    def turn(self, obj: dict, **fields: Any) -> Turn:
        usage = obj.get("usage") or {}
        return Turn(
            response=obj,
            model_served=obj.get("model"),
            text="".join(self.text) if self.text or not self.calls else None,
            tool_calls=self.calls or None,
            reasoning="".join(self.reasoning) or None,
            prompt_tokens=usage.get("input_tokens"),
            completion_tokens=usage.get("output_tokens"),
            **fields,
        )


_RESPONSE_DONE = ("response.completed", "response.incomplete", "response.failed")


def _responses_stream(events: list[Any]) -> Turn:
    final = None
    text: list[str] = []
    for ev in events:
        if not isinstance(ev, dict):
            continue
        kind = ev.get("type")
        if kind in _RESPONSE_DONE:
            final = ev.get("response")
        elif kind == "response.output_text.delta":
            text.append(ev.get("delta") or "")
        elif kind == "error":
            return Turn(response=ev, error=_error_text(ev) if "error" in ev else str(ev.get("message")))
    if isinstance(final, dict):
        return _responses(final)
    return Turn(response=None, text="".join(text), error="stream ended before response.completed")


def _messages(obj: dict) -> Turn:
    content = _Content()
    for block in obj.get("content") or ():
        kind = block.get("type")
        if kind == "text":
            content.text.append(block.get("text") or "")
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input"), ensure_ascii=False)
            content.calls.append({"id": block.get("id"), "name": block.get("name"), "arguments": arguments})
        elif kind == "thinking":
            content.reasoning.append(block.get("thinking") or "")
    return content.turn(obj, finish_reason=obj.get("stop_reason"))


def _messages_stream(events: list[Any]) -> Turn:
    message: dict[str, Any] = {}
    blocks: dict[int, dict] = {}
    partial: dict[int, list[str]] = {}
    for ev in events:
        if not isinstance(ev, dict):
            continue
        kind = ev.get("type")
        if kind == "message_start":
            message = dict(ev.get("message") or {})
        elif kind == "content_block_start":
            blocks[ev.get("index", len(blocks))] = dict(ev.get("content_block") or {})
        elif kind == "content_block_delta":
            block = blocks.setdefault(ev.get("index", 0), {"type": "text", "text": ""})
            delta = ev.get("delta") or {}
            dtype = delta.get("type")
            if dtype == "input_json_delta":
                partial.setdefault(ev.get("index", 0), []).append(delta.get("partial_json", ""))
            elif dtype in ("text_delta", "thinking_delta", "signature_delta"):
                key = dtype.removesuffix("_delta")  # the block's field that the delta's same-named field extends
                block[key] = (block.get(key) or "") + delta.get(key, "")
        elif kind == "message_delta":
            message.update({k: v for k, v in (ev.get("delta") or {}).items()})
            if ev.get("usage"):
                message["usage"] = {**(message.get("usage") or {}), **ev["usage"]}
        elif kind == "error":
            return Turn(response=ev, error=_error_text(ev))
    for index, pieces in partial.items():
        raw = "".join(pieces)
        try:
            blocks[index]["input"] = json.loads(raw) if raw else {}
        except ValueError:
            blocks[index]["input"] = raw
    message["content"] = [blocks[i] for i in sorted(blocks)]
    turn = _messages(message)
    if not message.get("stop_reason"):
        turn.error = "stream ended without a stop_reason"
    return turn
