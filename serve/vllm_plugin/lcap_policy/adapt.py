"""Request adaptation: what a harness written for a frontier API sends and vLLM refuses, made servable.

Each rule answers one of vLLM 0.32's real 400s (tests/e2e/test_policy_route.py replays them with
adaptation off, then on). It changes the request's JSON before vLLM validates it and says what it
changed and why, in the turn's record: nothing is changed silently. Token limits are clamped to the
context vLLM can actually give (`clamps`, once the prompt's length is known).
"""

from __future__ import annotations

from typing import Any

CHAT, MESSAGES, RESPONSES = "chat", "messages", "responses"
LIMIT_FIELDS = {
    CHAT: ("max_completion_tokens", "max_tokens"),
    MESSAGES: ("max_tokens",),
    RESPONSES: ("max_output_tokens",),
}


def change(field: str, action: str, before: Any, after: Any, why: str) -> dict[str, Any]:
    return {"field": field, "action": action, "from": before, "to": after, "why": why}


def adapt(
    dialect: str, body: dict[str, Any], max_model_len: int, *, thinking_budgets: bool
) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Make `body` acceptable to vLLM (in place): returns the token limits it lowered to max_model_len (as asked)
    and the list of other changes. `clamps` says what the limits became once the prompt's length is known.
    `thinking_budgets`: the server has a reasoning config, so it accepts a thinking budget."""
    changes: list[dict[str, Any]] = []
    requested = {}
    for name in LIMIT_FIELDS[dialect]:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_model_len:
            requested[name] = value
            body[name] = max_model_len  # vLLM then gives what the prompt leaves (`get_max_tokens`)
    if dialect == MESSAGES:
        _messages(body, changes, thinking_budgets)
    else:
        {CHAT: _chat, RESPONSES: _responses}[dialect](body, changes)
    return requested, changes


def override_temperature(body: dict[str, Any], temperature: float) -> dict[str, Any]:
    """Set the sampling temperature the proxy was told to use (`--temperature`) over the agent's, in place; the
    change as recorded. Every dialect names it `temperature`."""
    before = body.get("temperature")
    body["temperature"] = temperature
    return change("temperature", "set", before, temperature, "the proxy's --temperature")


def clamps(
    dialect: str, body_limits: dict[str, Any], requested: dict[str, int], max_model_len: int, prompt_tokens: int
) -> list[dict[str, Any]]:
    """The token limits vLLM actually applied: a requested limit over what the prompt leaves of the context is
    recorded as clamped (vLLM would clamp it silently, or refuse it past max_model_len)."""
    room = max_model_len - prompt_tokens
    out = []
    for name in LIMIT_FIELDS[dialect]:
        asked = requested.get(name, body_limits.get(name))
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > room:
            why = f"max_model_len {max_model_len} - prompt {prompt_tokens} tokens"
            out.append(change(name, "clamped", asked, room, why))
    return out


def _chat(body: dict[str, Any], changes: list) -> None:
    if "stream_options" in body and not body.get("stream"):
        changes.append(
            change("stream_options", "dropped", body.pop("stream_options"), None, "vLLM takes it only with stream")
        )
    tools = body.get("tools")
    if isinstance(tools, list):
        kept = [t for t in tools if not isinstance(t, dict) or t.get("type", "function") == "function"]
        for tool in tools:
            if tool not in kept:
                name = tool.get("name") or (tool.get(tool.get("type")) or {}).get("name")
                changes.append(
                    change("tools", "dropped", name, None, f"vLLM serves function tools only, not {tool.get('type')!r}")
                )
        _keep_tools(body, kept, [(t.get("function") or {}).get("name") for t in kept if isinstance(t, dict)], changes)


def _messages(body: dict[str, Any], changes: list, thinking_budgets: bool) -> None:
    tools = body.get("tools")
    if isinstance(tools, list):
        kept = [t for t in tools if not isinstance(t, dict) or "input_schema" in t]
        for tool in tools:
            if tool not in kept:
                why = f"a server tool ({tool.get('type')}) that only Anthropic runs"
                changes.append(change("tools", "dropped", tool.get("name"), None, why))
        _keep_tools(body, kept, [t.get("name") for t in kept if isinstance(t, dict)], changes)
    thinking = body.get("thinking")
    limit = body.get("max_tokens")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled" and not thinking_budgets:
        why = "the policy server has no reasoning parser, and vLLM refuses a thinking budget without one"
        changes.append(change("thinking", "dropped", body.pop("thinking"), None, why))
    elif isinstance(thinking, dict) and thinking.get("type") == "enabled" and isinstance(limit, int):
        budget = thinking.get("budget_tokens")
        if isinstance(budget, int) and budget >= limit:
            thinking["budget_tokens"] = max(limit - 1, 1)
            why = "must stay under max_tokens once max_tokens fits the policy's context"
            changes.append(change("thinking.budget_tokens", "clamped", budget, thinking["budget_tokens"], why))


def _responses(body: dict[str, Any], changes: list) -> None:
    for tool in body.get("tools") or ():
        grammar = (
            isinstance(tool, dict) and isinstance(tool.get("format"), dict) and tool["format"].get("type") == "grammar"
        )
        if grammar and tool.get("type") == "custom":
            why = "vLLM takes free-form custom tools only"
            changes.append(change(f"tools[{tool.get('name')}].format", "dropped", tool.pop("format"), None, why))
    items = body.get("input")
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("type") == "reasoning" and item.get("encrypted_content"):
                item.pop("encrypted_content")
                why = "another provider's encrypted reasoning, which vLLM cannot read"
                changes.append(
                    change("input[].encrypted_content", "dropped", f"reasoning item {item.get('id')}", None, why)
                )


def _keep_tools(body: dict[str, Any], kept: list, names: list, changes: list) -> None:
    if len(kept) == len(body["tools"]):
        return
    if kept:
        body["tools"] = kept
    else:
        del body["tools"]
    choice = body.get("tool_choice")
    named = (choice.get("name") or (choice.get("function") or {}).get("name")) if isinstance(choice, dict) else None
    forced = choice == "required" or (isinstance(choice, dict) and choice.get("type") in ("any", "tool", "function"))
    if (named is not None and named not in names) or (not kept and forced):
        body.pop("tool_choice")
        changes.append(change("tool_choice", "dropped", choice, None, "it named a tool that was dropped"))
