"""What a streamed answer goes through on its way to the agent, on either transport: each chunk is forwarded as it
comes and the turn keeps a copy (`StreamCopy`); lcap's endpoints' parts are taken out (`PolicyStream`), or the
fields `--token-ids` asked vLLM for (`SseRewriter`). `Calls.answer_head` picks one per stream."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from lcap.capture.routing import policy_wire
from lcap.capture.turns import dialects
from lcap.capture.turns.sse import SseCutter
from lcap.capture.turns.turn import PendingTurn


class StreamCopy:
    """The turn's copy of a stream, its first `limit` bytes: past them the stream still flows to the agent whole, and
    the turn keeps its start and says it was cut. Called with each chunk, it forwards the chunk as it is: the stream
    is never buffered."""

    __slots__ = ("kept", "limit", "pending")

    def __init__(self, pending: PendingTurn, limit: int) -> None:
        self.pending, self.limit, self.kept = pending, limit, 0

    def __call__(self, data: bytes) -> bytes:
        if data:
            self.add(data)
        return data

    def add(self, data: bytes) -> None:
        pending = self.pending
        chunks = pending.chunks
        assert chunks is not None
        if not chunks and not self.kept:
            pending.t_first = time.perf_counter()
        room = self.limit - self.kept
        if len(data) > room:
            if room > 0:
                chunks.append(data[:room])
            if pending.error is None:
                pending.error = f"capture: a stream over {self.limit} bytes (--max-body-bytes); the turn has its start"
            self.kept = self.limit
            return
        self.kept += len(data)
        chunks.append(data)


class PolicyStream:
    """A stream from lcap's endpoints: forwarded without lcap's parts (which go to `parts`); the turn
    keeps a copy of what the agent got."""

    def __init__(self, pending: PendingTurn, limit: int, parts: Callable[[bytes | None, bytes | None], None]) -> None:
        """`parts(record, head)`: told lcap's parts as they arrive (`Calls.policy_parts`)."""
        self.copy = StreamCopy(pending, limit)
        self.events = policy_wire.SseParts(parts, limit)

    def __call__(self, data: bytes) -> list[bytes]:
        out = self.events(data)
        for piece in out:
            self.copy.add(piece)
        return out


class SseRewriter:
    """vLLM path: forward each complete SSE event without the fields lcap asked for, keeping the original."""

    def __init__(self, pending: PendingTurn, limit: int) -> None:
        self.pending = pending
        self.limit = limit
        self.copy = StreamCopy(pending, limit)
        self.events = SseCutter()

    def __call__(self, data: bytes) -> list[bytes]:
        if not data:  # the end: whatever is left goes out as it is
            rest = self.events.rest()
            return [rest] if rest else []
        self.copy.add(data)
        out = [self._rewrite(event) for event in self.events.feed(data)]
        if len(self.events) > self.limit:  # no event end in sight: out as it is
            out.append(self.events.rest())
        return out

    def _rewrite(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            ending = line[len(line.rstrip(b"\r")) :]
            if not payload.startswith(b"{"):
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            assert self.pending.added is not None
            stripped = dialects.strip_added(obj, self.pending.added)
            lines[i] = b"data: " + json.dumps(stripped, ensure_ascii=False, separators=(",", ":")).encode() + ending
        return b"\n".join(lines)
