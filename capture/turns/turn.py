"""One finished call: what the proxy's hooks record (`PendingTurn`) and the `turns` row it becomes.

The hooks keep raw bytes and timings only; `build_row` does the parsing (JSON, SSE reassembly,
decompression, redaction) in the writer process, away from the proxy's event loop.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from lcap.capture.turns import dialects
from lcap.capture.turns.encoding import BodyTooLarge, UndecodableBody, decode_body, raw_body
from lcap.policy import DEFAULT_ROLE
from lcap.redact import redact_json, redact_keys, redact_path, redact_text

log = logging.getLogger("lcap.capture")


def agent_left(answered: bool) -> str:
    """The error of a call whose agent closed its connection (`answered`: the answer had begun)."""
    return f"the agent closed the connection {'during' if answered else 'before'} the answer"


_LEFT_DURING = agent_left(True)


_id_prefix: str
_id_counter: Iterator[int]


def new_turn_id() -> str:
    """A turn id unique across processes without a syscall per turn: this process's random 64 bits, then a
    counter (32 hex digits, like a UUID's)."""
    return f"{_id_prefix}{next(_id_counter):016x}"


def _new_id_space() -> None:
    global _id_prefix, _id_counter
    _id_prefix, _id_counter = os.urandom(8).hex(), itertools.count()


_new_id_space()
os.register_at_fork(after_in_child=_new_id_space)


class PendingTurn:
    """What the hooks record about one call; everything expensive happens later, in the writer process."""

    __slots__ = (
        "adapted",
        "added",
        "body_limit",
        "chunks",
        "deployment",
        "dialect",
        "done",
        "encoding",
        "episode_id",
        "error",
        "events",
        "host",
        "lcap_head",
        "lcap_record",
        "model_requested",
        "offered_thread",
        "offered_turn",
        "path",
        "policy",
        "replica",
        "request_body",
        "request_encoding",
        "request_json",
        "response_body",
        "role",
        "seq",
        "started_at",
        "status_code",
        "streamed",
        "t0",
        "t_end",
        "t_first",
        "tenant",
        "thread",
        "token_ids",
        "transport",
        "turn_id",
        "upstream",
    )

    def __init__(
        self, *, episode_id: str | None, seq: int | None, host: str, path: str, dialect: str, transport: str = "http"
    ) -> None:
        self.turn_id = new_turn_id()
        self.episode_id, self.seq = episode_id, seq
        self.tenant: str | None = None  # set when capture/proxy/sessions.py attributed the call from its body
        self.started_at = time.time()
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.host, self.path, self.dialect, self.transport = host, path, dialect, transport
        self.upstream: str | None = None
        self.model_requested: str | None = None
        self.role: str | None = None  # capture/proxy/roles.py: the header's, a --role-by rule's, or `default`
        self.deployment: str | None = None
        self.replica: str | None = None  # the policy replica lcap routed the call to: lcap's choice, never the agent's
        self.request_body: bytes = b""  # decoded, unless `request_encoding` says it could not be
        self.request_encoding: str | None = None  # the Content-Encoding of a request body kept encoded
        self.body_limit: int | None = None  # --max-body-bytes: the most bytes a body of this turn decodes to
        self.request_json: Any = None  # WebSocket: the response.create frame, already decoded
        self.chunks: list[bytes] | None = None  # SSE chunks as forwarded
        self.response_body: bytes = b""
        self.streamed = False
        self.encoding: str | None = None
        self.status_code: int | None = None
        self.error: str | None = None
        self.token_ids = False
        self.added: dialects.Added | None = None
        self.events: list[Any] | None = None  # WebSocket: decoded server events
        self.done = False
        # lcap's policy endpoints (capture/routing/policy_wire.py): served there, the parts they answered with, the head
        # the call was offered (its turn and thread) and the conversation it belongs to (key, messages)
        self.policy = False
        self.lcap_record: bytes | None = None
        self.lcap_head: bytes | None = None
        self.offered_turn: str | None = None
        self.offered_thread: int | None = None
        self.thread: tuple[int, int] | None = None
        self.adapted: list[dict] | None = None  # what the proxy changed itself (the model's name)


# A record of an lcap that did not write `body_limit` into it: the default --max-body-bytes of then
_OLD_BODY_LIMIT = 64 << 20


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _dumps(value: Any) -> str | None:
    return None if value is None else redact_keys(json.dumps(redact_json(value), ensure_ascii=False))


def build_row(p: PendingTurn) -> dict[str, Any]:
    """The `turns` row of a finished call."""
    error = p.error
    request = p.request_json
    request_encoding = getattr(p, "request_encoding", None)
    if request_encoding is not None:
        request = raw_body(p.request_body, request_encoding)
    elif request is None and p.request_body:
        try:
            request = json.loads(p.request_body)
        except (ValueError, RecursionError):
            request = p.request_body.decode("utf-8", "replace")
    turn = dialects.Turn()
    try:
        if p.events is not None:
            turn = dialects.assemble_events(p.dialect, p.events)
        else:
            raw = b"".join(p.chunks) if p.chunks is not None else p.response_body
            try:
                raw = decode_body(raw, p.encoding, getattr(p, "body_limit", None) or _OLD_BODY_LIMIT)
            except (BodyTooLarge, UndecodableBody) as exc:  # the turn keeps the answer as it came, and says why
                turn.response, turn.error = raw_body(raw, p.encoding), f"capture: the answer: {exc}"
                raw = b""
            if raw:
                turn = dialects.assemble(p.dialect, raw, p.streamed)
                if turn.response is None and not p.streamed:
                    turn.response = raw.decode("utf-8", "replace")
    except Exception as exc:
        log.warning("lcap: could not read the answer of %s %s: %s", p.dialect, p.path, exc)
        turn.error = turn.error or f"capture: {exc}"
    if p.status_code is not None and p.status_code >= 400 and not error:
        error = turn.error or f"HTTP {p.status_code}"
    if error == _LEFT_DURING and p.streamed and turn.error is None and turn.finish_reason is not None:
        error = None  # the stream's last event had come: clients (Codex CLI) close once they have it
    error = error or turn.error
    policy = _policy_fields(p, turn)
    has_ids = bool(turn.completion_token_ids) and p.token_ids
    if isinstance(request, dict) and p.model_requested is None:
        p.model_requested = request.get("model")
    ended = p.t_end if p.t_end is not None else p.t0
    return {
        "turn_id": p.turn_id,
        "episode_id": p.episode_id,
        "seq": p.seq,
        "started_at": _ts(p.started_at),
        "ended_at": _ts(p.started_at + (ended - p.t0)),
        "latency_ms": (ended - p.t0) * 1000.0,
        "ttft_ms": None if p.t_first is None else (p.t_first - p.t0) * 1000.0,
        "host": p.host,
        "path": redact_path(p.path),
        "dialect": p.dialect,
        "transport": p.transport,
        "stream": p.streamed,
        "upstream": p.upstream,
        "model_requested": p.model_requested,
        "model_served": turn.model_served,
        "deployment": p.deployment,
        "replica": getattr(p, "replica", None),  # a spool of an older lcap has no replica
        "role": getattr(p, "role", None) or DEFAULT_ROLE,  # nor a role; a WebSocket's calls take the default
        "request": _dumps(request),
        "response": _dumps(turn.response),
        "status_code": p.status_code,
        "error": redact_text(error),
        "finish_reason": turn.finish_reason,
        "completion_text": redact_keys(turn.text),
        "tool_calls": _dumps(turn.tool_calls),
        "reasoning": redact_keys(turn.reasoning),
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": turn.completion_tokens,
        "prompt_token_ids": turn.prompt_token_ids if has_ids else None,
        "completion_token_ids": turn.completion_token_ids if has_ids else None,
        "completion_logprobs": turn.completion_logprobs if has_ids else None,
        "token_source": "vllm" if has_ids else None,
        **policy,
    }


def _policy_fields(p: PendingTurn, turn: dialects.Turn) -> dict[str, Any]:
    """The columns lcap's policy endpoints fill (stitched, adaptations); their exact ids and logprobs go to `turn`."""
    record = _parse(p.lcap_record)
    stitched = bool(record.get("stitched")) if p.policy else None
    adaptations = list(p.adapted or ()) + list(record.get("adapted") or ())
    head = _parse(p.lcap_head) if record.get("exact") else {}
    ids, prompt_len = head.get("ids"), head.get("prompt_len")
    if isinstance(ids, list) and isinstance(prompt_len, int) and 0 < prompt_len < len(ids):
        turn.prompt_token_ids, turn.completion_token_ids = ids[:prompt_len], ids[prompt_len:]
        logprobs = record.get("logprobs")
        turn.completion_logprobs = logprobs if isinstance(logprobs, list) else None
    elif p.policy:  # the endpoints could not vouch for one prompt and one completion: no ids, rebuilt later
        turn.prompt_token_ids = turn.completion_token_ids = turn.completion_logprobs = None
    return {
        "stitched": stitched,
        "stitched_from": p.offered_turn if stitched else None,
        "thread_seq": p.offered_thread if stitched and p.offered_thread is not None else p.seq,
        "stitch_note": redact_text(record.get("note")) if p.policy else None,
        "adaptations": _dumps(adaptations) if adaptations else None,
    }


def _parse(raw: bytes | None) -> dict:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


_SURROGATE = re.compile("[\ud800-\udfff]")


def repair_text(value: Any, *, json_text: bool = False) -> Any:
    """A string that UTF-8 can carry: lone surrogates (a cut emoji's `\\ud83d`, a raw 0xFF byte decoded with
    surrogateescape) become the text `\\uXXXX`; inside JSON text, an escaped backslash and `uXXXX`, so the
    JSON value reads the same. Anything else is returned as it is."""
    if not isinstance(value, str) or value.isascii():
        return value
    slash = "\\\\" if json_text else "\\"
    return _SURROGATE.sub(lambda m: f"{slash}u{ord(m.group()):04x}", value)


def skeleton_row(p: PendingTurn, reason: str) -> dict[str, Any]:
    """A turn's identity, timing and status without its content: what is stored when its full row cannot be
    (its record is kept whole in dead_letters). Every value is checked, since the record is suspect."""

    def text(value: Any) -> str | None:
        return repair_text(value)[:10_000] if isinstance(value, str) else None

    def int32(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) and -(2**31) <= value < 2**31 else None

    def number(value: Any) -> float | None:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    row: dict[str, Any] = {
        "turn_id": text(getattr(p, "turn_id", None)),
        "degraded": f"stored without content: {reason}",
    }
    try:
        started, t0 = number(p.started_at), number(p.t0)
        ended = number(p.t_end) if p.t_end is not None else t0
        if started is not None and t0 is not None and ended is not None:
            row.update(started_at=_ts(started), ended_at=_ts(started + (ended - t0)), latency_ms=(ended - t0) * 1000.0)
    except Exception:  # a record this odd keeps no timing
        pass
    for name in (
        "episode_id",
        "host",
        "dialect",
        "transport",
        "upstream",
        "model_requested",
        "deployment",
        "replica",
        "role",
    ):
        row[name] = text(getattr(p, name, None))
    try:
        row["path"] = text(redact_path(p.path))
    except Exception:
        row["path"] = None
    row["seq"], row["status_code"] = int32(getattr(p, "seq", None)), int32(getattr(p, "status_code", None))
    row["stream"] = getattr(p, "streamed", False) is True
    row["error"] = text(f"capture: this turn could not be stored whole (see dead_letters): {reason}")
    return row
