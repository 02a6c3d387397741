"""The proxy's side of lcap's policy endpoints (serve/vllm_plugin/lcap_policy): paths, and taking lcap's parts out.

On the policy route, chat completions, Messages and Responses calls go to the policy server's
`/lcap/v1/...` endpoints (`lcap serve` starts vLLM with them). Their answers are the dialect's own,
plus two parts that the agent never sees: the turn's record (stitched or why not, what was adapted,
the behaviour logprobs) and the head (the turn's exact ids, sent back unread with the conversation's
next call). Where each part travels is written in lcap_policy/wire.py; these constants say the same
(a test compares them).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from lcap.capture.routing.routes import parse_upstream
from lcap.capture.turns.sse import SseCutter
from lcap.policy import bearer

PREFIX = "/lcap"
REQUEST_KEY = "lcap"
RECORD_EVENT = "lcap"
HEAD_EVENT = "lcap-head"
INFO_PATH = "/lcap/v1/info"
VERSION = 1

PATHS = {"chat": "/lcap/v1/chat/completions", "messages": "/lcap/v1/messages", "responses": "/lcap/v1/responses"}

_RECORD_SSE = b"event: lcap\n"
_HEAD_SSE = b"event: lcap-head\n"
_RECORD_FRAME = b'{"type":"lcap",'
_HEAD_FRAME = b'{"type":"lcap-head","head":'

Parts = Callable[[bytes | None, bytes | None], None]  # (record, head) as they arrive: one of them per call


def has_endpoints(base_url: str, timeout: float = 5.0, *, key: str | None = None) -> bool:
    """Whether the server at `base_url` has lcap's policy endpoints of this wire version (a vLLM that `lcap serve`
    started; a `--python` vLLM of another version may not load them). `key`: the bearer key the server requires
    (a replica on the network answers 401 without it, which would read as a server without them)."""
    import httpx  # start-up: httpx, asked of a policy server only

    route = parse_upstream(base_url, None)
    headers = bearer(key)
    url = f"{route.scheme}://{route.host}:{route.port}{INFO_PATH}"
    try:
        resp = httpx.get(url, timeout=timeout, trust_env=False, headers=headers)
        return resp.status_code == 200 and resp.json().get("version") == VERSION
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def request_body(
    forward: bytes, *, adapt: bool, stitch: bool, head: bytes | None, temperature: float | None = None
) -> bytes:
    """The request as the agent wrote it (`forward`: a JSON object, model already the deployment's) with lcap's
    member added; the head goes in as the bytes the endpoints sent, never decoded here. `temperature`: the
    sampling temperature the endpoints set over the agent's (`--temperature`), None to keep the agent's."""
    options = b'{"adapt":%s,"stitch":%s,"head":%s,"temperature":%s}' % (
        b"true" if adapt else b"false",
        b"true" if stitch else b"false",
        head if head is not None else b"null",
        json.dumps(float(temperature)).encode() if temperature is not None else b"null",
    )
    body = forward.rstrip()
    if not body.endswith(b"}"):
        raise ValueError("the request body is not a JSON object")
    inner = body[:-1].rstrip()
    return inner + (b"," if not inner.endswith(b"{") else b"") + b'"lcap":' + options + b"}"


def split_whole(body: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(answer, record, head) of a whole answer; None when it does not carry lcap's parts (an error answer)."""
    answer, sep, rest = body.partition(b"\n")
    record, sep2, head = rest.partition(b"\n")
    if not sep or not sep2 or not record.startswith(b"{"):
        return None
    return answer, record, head


def sse_part(event: bytes) -> tuple[bytes | None, bytes | None] | None:
    """(record, None) or (None, head) when one SSE event (ending in a blank line) is one of lcap's, else None."""
    if event.startswith(_RECORD_SSE):
        return _sse_data(event), None
    if event.startswith(_HEAD_SSE):
        return None, _sse_data(event)
    return None


def _sse_data(event: bytes) -> bytes:
    start = event.find(b"\ndata: ") + 7
    return event[start:].rstrip(b"\n")


def frame_part(content: bytes) -> tuple[bytes | None, bytes | None] | None:
    """The same for a WebSocket frame: (record, None), (None, head), or None for the dialect's own frames."""
    if content.startswith(_HEAD_FRAME):
        return None, content[len(_HEAD_FRAME) : -1]
    if content.startswith(_RECORD_FRAME):
        return b"{" + content[len(_RECORD_FRAME) :], None
    return None


class SseParts:
    """A stream from lcap's endpoints, forwarded event by event without lcap's two events, which go to `parts`.

    Events are cut at their blank line; what has no end within `limit` bytes goes out as it is (the agent's
    stream never waits on lcap)."""

    def __init__(self, parts: Parts, limit: int) -> None:
        self.parts = parts
        self.limit = limit
        self.events = SseCutter()

    def __call__(self, data: bytes) -> list[bytes]:
        if not data:  # the end: whatever is left goes out
            rest = self.events.rest()
            return [rest] if rest else []
        out = []
        for event in self.events.feed(data):
            part = sse_part(event) if event.startswith(b"event: lcap") else None
            if part is None:
                out.append(event)
            else:
                self.parts(*part)
        if len(self.events) > self.limit:
            out.append(self.events.rest())
        return out
