"""What lcap learns about one call while vLLM serves it (lcap_policy.endpoints fills it in): its exact ids and
logprobs, the record the proxy gets, and the stitching head it answers with."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lcap_policy import adapt, stitch


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@dataclass
class Turn:
    """What lcap learns about one call while vLLM serves it: the record and the head it answers with."""

    dialect: str
    adapted: list[dict] = field(default_factory=list)
    requested: dict[str, int] = field(default_factory=dict)  # token limits over max_model_len, as asked
    limits: dict[str, Any] = field(default_factory=dict)  # token limits as vLLM got them
    stitched: bool = False
    note: str | None = None  # why the turn was not stitched onto a previous one (when one was offered)
    exact: bool = True  # False when the ids are not one prompt and one completion (n > 1, built-in tool loops)
    prompt_ids: list[int] | None = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    stop_reason: Any = None
    text: list[str] = field(default_factory=list)
    calls: dict[int, dict] = field(default_factory=dict)
    produced: list[dict] | None = None  # the assistant message(s) the agent got, as chat messages
    n: int = 0
    digests: list[str] = field(default_factory=list)
    context: str = ""
    stop_ids: frozenset[int] = frozenset()
    max_model_len: int = 0
    history: list[Any] | None = None  # Responses: the call's whole input items, kept with its answer

    # --- reading what vLLM produced ---

    def take_chat(self, obj: dict) -> None:
        """One chat answer or stream chunk (as JSON), from the chat path asked for ids and logprobs."""
        if obj.get("prompt_token_ids"):
            self.prompt_ids = obj["prompt_token_ids"]
        choices = obj.get("choices") or ()
        if len(choices) > 1 or any((c.get("index") or 0) > 0 for c in choices):
            self.exact = False
        for choice in choices:
            if (choice.get("index") or 0) != 0:
                continue
            self.completion_ids.extend(choice.get("token_ids") or ())
            content = (choice.get("logprobs") or {}).get("content") or ()
            self.logprobs.extend(float(item["logprob"]) for item in content)
            self.finish = choice.get("finish_reason") or self.finish
            if "stop_reason" in choice and choice.get("finish_reason"):
                self.stop_reason = choice["stop_reason"]
            message = choice.get("message") or choice.get("delta") or {}
            if message.get("content"):
                self.text.append(message["content"])
            for call in message.get("tool_calls") or ():
                slot = self.calls.setdefault(call.get("index", len(self.calls)), {"name": None, "arguments": ""})
                function = call.get("function") or {}
                slot["name"] = function.get("name") or slot["name"]
                slot["arguments"] += function.get("arguments") or ""

    def take_engine_output(self, output: Any, delta: bool) -> None:
        """One engine output (Responses): ids and the sampled tokens' logprobs."""
        if self.prompt_ids is None:
            self.prompt_ids = list(output.prompt_token_ids or ())
        elif list(output.prompt_token_ids or ()) != self.prompt_ids:
            self.exact = False  # a second generation (a built-in tool's loop): not one prompt, one completion
            return
        completion = output.outputs[0]
        ids = list(completion.token_ids or ())
        logprobs = [step[token].logprob for token, step in zip(ids, completion.logprobs or ())]
        if delta:
            self.completion_ids.extend(ids)
            self.logprobs.extend(logprobs)
        else:
            self.completion_ids, self.logprobs = ids, logprobs
        if completion.finish_reason is not None:
            self.finish, self.stop_reason = completion.finish_reason, completion.stop_reason

    # --- what it answers with ---

    def chat_message(self) -> dict:
        calls = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(self.calls.items())
        ]
        return {"role": "assistant", "content": "".join(self.text), "tool_calls": calls}

    def record(self) -> dict:
        prompt_tokens = len(self.prompt_ids or ())
        clamped = adapt.clamps(self.dialect, self.limits, self.requested, self.max_model_len, prompt_tokens)
        exact = self.exact and self.prompt_ids is not None and bool(self.completion_ids)
        return {
            "stitched": self.stitched,
            "note": self.note,
            "adapted": self.adapted + clamped,
            "exact": exact,
            "logprobs": self.logprobs if exact and len(self.logprobs) == len(self.completion_ids) else None,
        }

    def head(self) -> stitch.Head | None:
        if not (self.exact and self.prompt_ids and self.completion_ids and self.digests):
            return None
        last = self.completion_ids[-1]
        ended = self.finish in ("stop", "tool_calls") and not isinstance(self.stop_reason, str)
        produced = self.produced if self.produced is not None else [self.chat_message()]
        return stitch.Head(
            ids=self.prompt_ids + self.completion_ids,
            prompt_len=len(self.prompt_ids),
            n=self.n,
            digests=self.digests,
            context=self.context,
            out=stitch.assistant_digest(produced),
            stop=last if ended and last in self.stop_ids else None,
        )

    def trailer(self) -> tuple[str, str]:
        head = self.head()
        return dumps(self.record()), head.dumps() if head is not None else "null"
