"""The responses lcap's Responses endpoint served, kept so that a later call can name one in `previous_response_id`.

A client that continues a conversation with `previous_response_id` (Codex CLI over its WebSocket) sends only
what is new; the rest is the earlier call's input and the answer it got. lcap resolves such a call itself:
the request becomes the earlier call's whole input, its output items, then the new input, and is served as
any other call, stitched onto the earlier turn's exact ids (its head, kept here with it). vLLM's own store
(VLLM_ENABLE_RESPONSES_API_STORE) never forgets anything; this one keeps at most `max_responses`, each for at
most `max_age` seconds, and drops the oldest first. A call naming one that is gone gets a 4xx that says which
bound dropped it (or that it was never served here), counted in `stats` and logged.

An entry's history shares its items with the entry it extends, so a conversation's text is held once, not
once per turn. Nothing here imports vLLM.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES_ENV = "LCAP_RESPONSES_MAX"  # set by `lcap serve` from ServeOptions; unset: no store
MAX_AGE_ENV = "LCAP_RESPONSES_MAX_AGE"


@dataclass(frozen=True, slots=True)
class Stored:
    history: tuple[Any, ...]  # the call's whole input (items, resolved), then its output items
    head: str | None  # the turn's head (exact prompt + completion ids), as the endpoints send it; None: none
    at: float


class ResponseStore:
    """Response id -> what a call continuing it needs; bounded in count and age, oldest first out."""

    def __init__(self, max_responses: int, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_responses = max_responses
        self.max_age = max_age
        self.clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()  # ids dropped lately -> which bound dropped them
        self._lock = threading.Lock()
        self.stats = {"stored": 0, "resolved": 0, "missed": 0, "evicted": 0, "expired": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def limits(self) -> str:
        return f"the last {self.max_responses} responses, each for {self.max_age:g} s"

    def put(self, response_id: str, history: Sequence[Any], head: str | None) -> None:
        if self.max_responses <= 0:
            return
        with self._lock:
            now = self.clock()
            self._expire(now)
            self._entries.pop(response_id, None)
            self._entries[response_id] = Stored(tuple(history), head, now)
            self.stats["stored"] += 1
            while len(self._entries) > self.max_responses:
                victim, _ = self._entries.popitem(last=False)
                self._forget(victim, f"more than {self.max_responses} responses were served after it")
                self.stats["evicted"] += 1

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
            oldest, stored = next(iter(self._entries.items()))
            if now - stored.at <= self.max_age:
                return
            del self._entries[oldest]
            self._forget(oldest, f"it was older than {self.max_age:g} s")
            self.stats["expired"] += 1

    def _forget(self, response_id: str, why: str) -> None:
        self._gone[response_id] = why
        while len(self._gone) > max(self.max_responses, 1):  # only to say why: as bounded as the store
            self._gone.popitem(last=False)


def from_env(environ: dict[str, str]) -> ResponseStore | None:
    """The store `lcap serve` asked for (its options travel in the environment: the plugin imports nothing of lcap)."""
    count = environ.get(MAX_RESPONSES_ENV)
    if not count:
        return None
    return ResponseStore(int(count), float(environ.get(MAX_AGE_ENV) or "inf"))


def input_items(value: Any) -> list[Any]:
    """A Responses `input` as a list of items (a plain string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else [value]
