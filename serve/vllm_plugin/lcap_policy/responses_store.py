"""The responses lcap's Responses endpoint served, kept so that a later call can name one in `previous_response_id`.

A client that continues a conversation with `previous_response_id` (Codex CLI over its WebSocket) sends only
what is new; the rest is the earlier call's input and the answer it got. lcap resolves such a call itself:
the request becomes the earlier call's whole input, its output items, then the new input, and is served as
any other call, stitched onto the earlier turn's exact ids (its head, kept here with it). vLLM's own store
(VLLM_ENABLE_RESPONSES_API_STORE) never forgets anything; this one keeps at most `max_responses`, each for at
most `max_age` seconds, holding at most `max_bytes` in all, and drops the oldest first. A call naming one that
is gone gets a 4xx that says which bound dropped it (or that it was never served here), counted in `stats` and
logged.

An entry's history shares its items with the entry it extends, so a conversation's text is held once, not
once per turn, and counted once against `max_bytes` (each item's JSON size, while any entry holds it); each
entry's head (its exact ids, as JSON) is its own. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES_ENV = "LCAP_RESPONSES_MAX"  # set by `lcap serve` from ServeOptions; unset: no store
MAX_AGE_ENV = "LCAP_RESPONSES_MAX_AGE"
MAX_BYTES_ENV = "LCAP_RESPONSES_MAX_BYTES"


@dataclass(frozen=True, slots=True)
class Stored:
    history: tuple[Any, ...]  # the call's whole input (items, resolved), then its output items
    head: str | None  # the turn's head (exact prompt + completion ids), as the endpoints send it; None: none
    at: float


class ResponseStore:
    """Response id -> what a call continuing it needs; bounded in count, age and bytes, oldest first out."""

    def __init__(
        self,
        max_responses: int,
        max_age: float,
        max_bytes: float = float("inf"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_responses = max_responses
        self.max_age = max_age
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._items: dict[int, list[Any]] = {}  # id(item) -> [item, entries holding it, its bytes]
        self.bytes = 0  # what the entries hold: their distinct items and their heads
        self._gone: OrderedDict[str, str] = OrderedDict()  # ids dropped lately -> which bound dropped them
        self._lock = threading.Lock()
        self.stats = {"stored": 0, "resolved": 0, "missed": 0, "evicted": 0, "expired": 0, "over_bytes": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def limits(self) -> str:
        held = "" if self.max_bytes == float("inf") else f", {self.max_bytes:g} bytes in all"
        return f"the last {self.max_responses} responses, each for {self.max_age:g} s{held}"

    def put(self, response_id: str, history: Sequence[Any], head: str | None) -> None:
        if self.max_responses <= 0:
            return
        with self._lock:
            now = self.clock()
            self._expire(now)
            if response_id in self._entries:
                self._release(self._entries.pop(response_id))
            stored = Stored(tuple(history), head, now)
            self._hold(stored)
            self._entries[response_id] = stored
            self.stats["stored"] += 1
            while len(self._entries) > self.max_responses:
                self._drop_oldest(f"more than {self.max_responses} responses were served after it")
                self.stats["evicted"] += 1
            while self.bytes > self.max_bytes:
                self._drop_oldest(f"the responses kept after it held more than {self.max_bytes:g} bytes")
                self.stats["over_bytes"] += 1

    def get(self, response_id: str) -> tuple[Stored | None, str]:
        """(the stored response, "") or (None, why it is not here)."""
        with self._lock:
            self._expire(self.clock())
            stored = self._entries.get(response_id)
            if stored is not None:
                self.stats["resolved"] += 1
                return stored, ""
            self.stats["missed"] += 1
            why = self._gone.get(response_id) or "it was not served by this policy server (or before it restarted)"
            return None, why

    def _expire(self, now: float) -> None:
        while self._entries:
            stored = next(iter(self._entries.values()))
            if now - stored.at <= self.max_age:
                return
            self._drop_oldest(f"it was older than {self.max_age:g} s")
            self.stats["expired"] += 1

    def _drop_oldest(self, why: str) -> None:
        victim, stored = self._entries.popitem(last=False)
        self._release(stored)
        self._forget(victim, why)

    def _hold(self, stored: Stored) -> None:
        for item in stored.history:
            held = self._items.get(id(item))
            if held is None:
                size = len(json.dumps(item, default=str))
                self._items[id(item)] = [item, 1, size]
                self.bytes += size
            else:
                held[1] += 1
        self.bytes += len(stored.head or "")

    def _release(self, stored: Stored) -> None:
        for item in stored.history:
            held = self._items[id(item)]
            held[1] -= 1
            if held[1] == 0:
                del self._items[id(item)]
                self.bytes -= held[2]
        self.bytes -= len(stored.head or "")

    def _forget(self, response_id: str, why: str) -> None:
        self._gone[response_id] = why
        while len(self._gone) > max(self.max_responses, 1):  # only to say why: as bounded as the store
            self._gone.popitem(last=False)


def from_env(environ: dict[str, str]) -> ResponseStore | None:
    """The store `lcap serve` asked for (its options travel in the environment: the plugin imports nothing of lcap)."""
    count = environ.get(MAX_RESPONSES_ENV)
    if not count:
        return None
    return ResponseStore(
        int(count), float(environ.get(MAX_AGE_ENV) or "inf"), float(environ.get(MAX_BYTES_ENV) or "inf")
    )


def input_items(value: Any) -> list[Any]:
    """A Responses `input` as a list of items (a plain string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else [value]


# output items that vLLM reads back as an assistant message
_ANSWER_TYPES = frozenset({"message", "function_call", "custom_tool_call", "reasoning"})
_EMPTY_TEXT = {"type": "output_text", "text": "", "annotations": []}


def filled(item: Any) -> Any:
    """An output item as vLLM reads it back: a message sent without content gets one empty text part."""
    if isinstance(item, dict) and item.get("type") == "message" and not item.get("content"):
        return {**item, "content": [_EMPTY_TEXT]}
    return item


def answer_items(output: Sequence[Any]) -> list[Any]:
    """A response's output items as the history a later call continues. The model always answers, if only with
    its stop token, but vLLM leaves an empty answer's message out (or, without a parser, sends it with no
    content, which its own input reader cannot read back: `filled`): without an assistant message there, the
    next call is not stitched onto this turn's exact ids. An empty answer becomes one empty assistant message."""
    items = [filled(item) for item in output]
    if not any(isinstance(item, dict) and item.get("type") in _ANSWER_TYPES for item in items):
        empty = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed"}
        items.append({**empty, "content": [_EMPTY_TEXT]})
    return items
