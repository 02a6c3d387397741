"""Re-tokenise turns that were captured without token ids (e.g. a call that did not go to vLLM).

Re-rendering a conversation through the chat template is not guaranteed to give the tokens the
model produced (decode -> encode is not the identity; tool parsers rewrite content), so every
sample built from these ids is flagged `rebuilt` and carries logprob 0.0: the trainer must not use
them as behaviour logprobs. Results are cached in the `rebuilt_turns` table, one row per turn.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from typing import Any

from lcap.capture import anthropic_entries, content_blocks, responses_entries
from lcap.policy import read_policy
from lcap.schema import TRUNCATED_REASONS
from lcap.store import Store, now

_PENDING = """
SELECT t.turn_id, t.dialect, t.request, t.completion_text, t.tool_calls, t.finish_reason,
       d.base_model, t.model_served
FROM turns t
JOIN episode_advantages a USING (episode_id)
LEFT JOIN (SELECT name, arg_max(base_model, coalesce(created_at, TIMESTAMPTZ '-infinity')) AS base_model
                  FROM deployments GROUP BY name) d
       ON d.name = t.deployment
WHERE a.round = $round AND a.split = $split
  AND ($episodes::VARCHAR[] IS NULL OR t.episode_id IN (SELECT unnest($episodes::VARCHAR[])))
  AND (t.token_source IS NULL OR t.prompt_token_ids IS NULL OR t.completion_token_ids IS NULL
       OR ($teachers AND t.deployment IS NULL))
  AND t.error IS NULL AND coalesce(t.status_code, 200) < 400
  AND t.turn_id NOT IN (SELECT turn_id FROM rebuilt_turns WHERE $tokenizer IS NULL OR tokenizer = $tokenizer)
"""


def rebuild_missing_tokens(
    store: Store,
    *,
    round: int,
    split: str,
    tokenizer: str | None = None,
    teachers: bool = False,
    episodes: list[str] | None = None,
) -> tuple[int, int]:
    """Fill `rebuilt_turns` for the round's trainable turns that lack ids, and with `teachers` (SFT) for the turns
    no policy deployment served (a teacher API's, whatever ids it gave: they are not the student's); returns
    (rebuilt, unrebuildable); with `episodes`, only theirs. A turn is re-tokenised once per named `tokenizer`; the latest rebuild is the one read."""
    pending = store.fetchall(
        _PENDING, {"round": round, "split": split, "teachers": teachers, "tokenizer": tokenizer, "episodes": episodes}
    )
    if not pending:
        return 0, 0
    rows: list[dict[str, Any]] = []
    failed = 0
    for turn_id, dialect, request, text, tool_calls, finish_reason, base_model, served in pending:
        name = tokenizer or base_model or _policy_base_model() or served
        try:
            tok = load_tokenizer(name) if name else None
            ids = (
                rebuild_turn(
                    tok, dialect, json.loads(request or "{}"), text, json.loads(tool_calls or "null"), finish_reason
                )
                if tok
                else None
            )
        except Exception as exc:  # a bad template or request: count it, the other turns still build
            print(f"lcap: cannot re-tokenise turn {turn_id}: {exc}", file=sys.stderr)
            ids = None
        if ids is None:
            failed += 1
            continue
        rows.append(
            {
                "turn_id": turn_id,
                "prompt_token_ids": ids[0],
                "completion_token_ids": ids[1],
                "tokenizer": name,
                "created_at": now(),
            }
        )
    store.append("rebuilt_turns", rows)
    return len(rows), failed


def rebuild_turn(
    tokenizer, dialect: str | None, request: dict, text: str | None, tool_calls: Any, finish_reason: str | None
) -> tuple[list[int], list[int]] | None:
    """(prompt ids, completion ids) for one call, or None when its dialect cannot be re-rendered."""
    text = text or ""
    if dialect == "completions":
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            return None
        return _encode(tokenizer, prompt), _encode(tokenizer, text)
    if dialect == "messages":
        messages, tools = chat_from_anthropic(request)
    elif dialect in (None, "chat") and isinstance(request.get("messages"), list):
        messages, tools = request["messages"], request.get("tools") or None
    elif dialect == "responses" and (conversation := chat_from_responses(request)) is not None:
        messages, tools = conversation
    else:
        return None
    prompt_text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    prompt_ids = _encode(tokenizer, prompt_text)
    if finish_reason in TRUNCATED_REASONS:
        # A completion cut by the token limit ends without a stop token: none is added.
        return prompt_ids, _encode(tokenizer, text)
    assistant: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        assistant["tool_calls"] = tool_calls
    full_ids = _encode(tokenizer, tokenizer.apply_chat_template(messages + [assistant], tools=tools, tokenize=False))
    if full_ids[: len(prompt_ids)] != prompt_ids:
        completion = _encode(tokenizer, text) + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        return prompt_ids, completion
    completion = full_ids[len(prompt_ids) :]
    # The template may add a newline after the end-of-turn token; the model stopped at the token.
    eos = tokenizer.eos_token_id
    if eos is not None and eos in completion:
        completion = completion[: len(completion) - completion[::-1].index(eos)]
    return prompt_ids, completion


def chat_from_anthropic(request: dict) -> tuple[list[dict], list[dict] | None]:
    """An Anthropic Messages request as chat-template messages and tools (vLLM returns no ids for it)."""
    messages: list[dict[str, Any]] = []
    for entry in anthropic_entries(request):
        content = entry.content
        if entry.role == "system" and entry.raw is None:  # the request's `system`
            content = _joined_text(content) if isinstance(content, list) else content
            if content:
                messages.append({"role": "system", "content": content})
            continue
        if isinstance(content, str):
            messages.append({"role": entry.role, "content": content})
            continue
        texts, calls = [], []
        for block in content_blocks(content):
            if block.kind == "text":
                texts.append(block.text or "")
            elif block.kind == "call":
                calls.append({"id": block.call_id, "name": block.name, "arguments": block.arguments or {}})
            elif block.kind == "result":
                result = _joined_text(block.content) if isinstance(block.content, list) else block.content
                messages.append({"role": "tool", "tool_call_id": block.call_id, "content": result or ""})
        if texts or calls:
            messages.append({"role": entry.role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    tools = [
        _function_tool(t.get("name"), t.get("description", ""), t.get("input_schema"))
        for t in request.get("tools") or []
        if t.get("name")
    ]
    return messages, tools or None


def _joined_text(content: list) -> str:
    """Content blocks' text, joined (other blocks left out)."""
    return "".join(block.text or "" for block in content_blocks(content) if block.kind == "text")


def _function_tool(name: Any, description: Any, parameters: Any) -> dict[str, Any]:
    """A tool as chat templates read it."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters or {}}}


_RESPONSES_TEXT = ("input_text", "output_text", "text")


def chat_from_responses(request: dict) -> tuple[list[dict], list[dict] | None] | None:
    """A Responses request as chat-template messages and tools, or None where the request alone does not hold its
    conversation: it continues another (`previous_response_id`, `conversation`), or its input holds an item that is
    not a message, a function call, a function call's output or reasoning (a stored item's reference, a built-in
    tool's call). `instructions` and developer messages are system messages; a function call joins the assistant
    message before it; reasoning summaries go to the next assistant message's `reasoning_content`. Content that is
    all text becomes a string; other parts (images, files) are kept as they are."""
    if request.get("previous_response_id") or request.get("conversation"):
        return None
    if not isinstance(request.get("input"), (str, list)):
        return None
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for entry in responses_entries(request):
        if entry.kind == "message":
            role = "system" if entry.role == "developer" else entry.role
            message: dict[str, Any] = {"role": role, "content": _responses_content(entry.content)}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif entry.kind == "call" and not entry.custom:
            call = {
                "id": entry.call_id,
                "type": "function",
                "function": {"name": entry.name, "arguments": entry.arguments or "{}"},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif entry.kind == "result" and not entry.custom:
            messages.append(
                {"role": "tool", "tool_call_id": entry.call_id, "content": _responses_content(entry.content)}
            )
        elif entry.kind == "reasoning":
            reasoning = entry.text
        else:
            return None
    tools = [
        _function_tool(t["name"], t.get("description") or "", t.get("parameters"))
        for t in request.get("tools") or ()
        if isinstance(t, dict) and t.get("type") == "function" and t.get("name")
    ]
    return messages, tools or None


def _responses_content(content: Any) -> Any:
    """Responses content parts as chat content: one string when every part is text, else the parts as they are."""
    if not isinstance(content, list):
        return content
    if all(
        isinstance(p, dict) and p.get("type") in _RESPONSES_TEXT and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return content


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str):
    from transformers import AutoTokenizer  # the train extra

    return AutoTokenizer.from_pretrained(name)


def _policy_base_model() -> str | None:
    policy = read_policy()
    return policy.base_model if policy else None


def rerender_changes(decoded: str, text: str | None, tool_calls: Any) -> list[str]:
    """What re-rendering a call changed, from the re-rendered completion decoded without special tokens:
    `whitespace` (its text is there only with whitespace collapsed) and `tool JSON` (a tool call's arguments, as
    the model wrote them, are not there as written: the template re-serialised them)."""
    changes = []
    if text and text not in decoded:
        changes.append("whitespace" if _collapsed(text) in _collapsed(decoded) else "text")
    arguments = [call.get("arguments") if isinstance(call, dict) else None for call in tool_calls or ()]
    if any(isinstance(written, str) and written not in decoded for written in arguments):
        changes.append("tool JSON")
    return changes


def _collapsed(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()
