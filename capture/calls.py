"""What lcap does with one LLM call, whichever listener carried it: attribute, reroute, record, finish.

Two transports drive these methods: the front's short path (capture/front.py) and the mitmproxy
addon (capture/addon.py) for everything the front hands over. Both speak in plain values (header
fields as byte pairs, bodies as bytes), so capture has one implementation. Everything here is
cheap: raw bytes and timings go on a `PendingTurn`, and the writer process does the parsing.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from lcap.capture import dialects
from lcap.capture.redact import CREDENTIAL_HEADERS
from lcap.capture.turn import PendingTurn
from lcap.capture.writer import TurnWriter

log = logging.getLogger("lcap.capture")

Fields = Sequence[tuple[bytes, bytes]]  # header fields: (name, value) pairs
EPISODE_HEADER = b"x-lcap-episode"
_CREDENTIALS = frozenset(name.encode() for name in CREDENTIAL_HEADERS)


# --- where calls go ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """Where a recognised call goes instead of its original host."""

    scheme: str
    host: str
    port: int
    base_path: str  # e.g. "" or "/v1"
    model: str | None  # the model to ask for, or None to keep the agent's
    deployment: str | None  # the policy deployment name stored on the turn

    @functools.cached_property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.base_path}"

    @functools.cached_property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default else f"{host}:{self.port}").encode("idna")

    def path_for(self, agent_path: str) -> str:
        """Map the agent's path onto the upstream: keep it whole, or graft what follows `/v1`."""
        if not self.base_path:
            return agent_path
        path, sep, query = agent_path.partition("?")
        idx = path.find("/v1/")
        tail = path[idx + 3 :] if idx >= 0 else path
        return f"{self.base_path}{tail}{sep}{query}"


def parse_upstream(url: str, model: str | None, deployment: str | None = None) -> Route:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Route(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), model, deployment)


class Router:
    """Resolves the route of each call: fixed URL, the policy record (re-read when it changes), or none."""

    def __init__(self, upstream: str | None, model: str | None) -> None:
        self.upstream, self.model = upstream, model
        self._fixed = parse_upstream(upstream, model) if upstream not in (None, "policy") else None
        self._checked = 0.0
        self._mtime: int | None = -1
        self._policy_route: Route | None = None
        self._lock = threading.Lock()

    def route(self) -> Route | None:
        if self.upstream != "policy":
            return self._fixed
        now = time.monotonic()
        if now - self._checked >= 0.5:
            with self._lock:
                self._refresh(now)
        return self._policy_route

    def _refresh(self, now: float) -> None:
        from lcap.policy import read_policy, record_path

        self._checked = now
        try:
            mtime = os.stat(record_path()).st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            record = read_policy()
            route = parse_upstream(record.url, self.model or record.current, record.current) if record else None
        except (ValueError, TypeError) as exc:  # a record being rewritten: keep the last good route
            log.warning("lcap: unreadable policy record (%s); keeping the previous route", exc)
            return
        self._policy_route = route


# --- which episode ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def episode_from_proxy_auth(value: str | None) -> str | None:
    """The episode named as the user of `http://EPISODE@host:port` (Basic proxy credentials)."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(token.strip()).decode("utf-8").partition(":")
    except Exception:
        return None
    return unquote(user or password) or None


def take_episode(fields: Fields) -> tuple[str | None, Fields]:
    """The episode a request names (lcap's header, else the proxy credentials), and its fields without them."""
    named = auth = None
    keep = []
    for field in fields:
        name = field[0].lower()
        if name == EPISODE_HEADER:
            named = field[1].decode("utf-8", "replace")
        elif name == b"proxy-authorization":
            auth = field[1].decode("latin-1")
        else:
            keep.append(field)
    if named is None and auth is None:
        return None, fields
    return named or episode_from_proxy_auth(auth), tuple(keep)


# --- one call ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Call:
    """A request to an LLM path and how to forward it."""

    pending: PendingTurn
    route: Route | None
    scheme: str
    host: str
    port: int
    path: str
    fields: Fields  # the request's header fields, minus lcap's own (and the agent's credentials when rerouted)
    body: bytes = b""  # the request body to send (rewritten when lcap changed it)


class Calls:
    """Attribution, rerouting and recording of LLM calls; the transports call these in order:
    `open_call` (the head), `take_body`, `answer_head`, then `answer_body` (a whole answer) or `close_call`
    (a stream, or a failure)."""

    def __init__(
        self, writer: TurnWriter, router: Router, *, token_ids: bool, upstream_api_key: str | None = None
    ) -> None:
        self.writer = writer
        self.router = router
        self.token_ids = token_ids
        self.upstream_api_key = upstream_api_key
        self._seq: defaultdict[str | None, int] = defaultdict(int)
        self._seq_lock = threading.Lock()
        self.in_flight: defaultdict[str | None, int] = defaultdict(int)  # calls numbered and not closed yet

    def next_seq(self, episode: str | None) -> int:
        with self._seq_lock:
            seq = self._seq[episode]
            self._seq[episode] = seq + 1
            self.in_flight[episode] += 1
        return seq

    def busy(self, episode: str | None = None, *, any_episode: bool = False) -> bool:
        if any_episode:
            return any(n > 0 for n in self.in_flight.values())
        return self.in_flight.get(episode, 0) > 0

    def open_call(
        self, dialect: str, episode: str | None, *, scheme: str, host: str, port: int, path: str, fields: Fields
    ) -> Call:
        """A request to an LLM path, from its head alone: its route, its header fields for that route, and a
        turn not recorded yet. Clients often write the body separately: this work is then done while it comes."""
        route = self.router.route()
        pending = PendingTurn(episode_id=episode, seq=None, host=host, path=path, dialect=dialect)
        call = Call(pending, route, scheme, host, port, path, fields)
        if route is None:
            pending.upstream = f"{scheme}://{host}:{port}"
            return call
        drop = _CREDENTIALS
        if self.token_ids and dialect in dialects.TOKEN_ID_DIALECTS:
            drop = _CREDENTIALS | {b"accept-encoding"}  # answers are rewritten: keep them plain
        call.fields = self.rerouted_fields(fields, route, drop)
        call.scheme, call.host, call.port, call.path = route.scheme, route.host, route.port, route.path_for(path)
        pending.upstream = route.url
        pending.deployment = route.deployment
        return call

    def take_body(self, call: Call, body: bytes) -> bool:
        """The request's body. True: an LLM call, now numbered in its episode and recorded from here on (its body
        rewritten when the route says so). False: a side call that shares the path; nothing is recorded, and
        the request goes on as it came, to its own host."""
        try:
            request = json.loads(body)
        except ValueError:
            return False
        pending = call.pending
        if not dialects.looks_like_call(pending.dialect, request):
            return False
        pending.request_body = call.body = body
        pending.model_requested = request.get("model")
        if call.route is not None:
            forward = with_route_model(request, call.route)
            if self.token_ids:
                pending.added = dialects.ask_token_ids(pending.dialect, forward)
                pending.token_ids = pending.added is not None
            if forward != request:
                call.body = json.dumps(forward, ensure_ascii=False).encode()
        pending.started_at, pending.t0 = time.time(), time.perf_counter()  # the call starts once it is whole
        pending.seq = self.next_seq(pending.episode_id)
        return True

    def rerouted_fields(self, fields: Fields, route: Route, drop: frozenset[bytes] = _CREDENTIALS) -> Fields:
        """The agent's fields for `route`: its credentials for the original host go, the Host field follows."""
        out = []
        for field in fields:
            name = field[0].lower()
            if name == b"host":
                out.append((field[0], route.host_header))
            elif name not in drop:
                out.append(field)
        if self.upstream_api_key:
            out.append((b"authorization", f"Bearer {self.upstream_api_key}".encode()))
        return tuple(out)

    def answer_head(
        self, pending: PendingTurn, status: int, content_type: str, encoding: str | None
    ) -> Callable[[bytes], bytes | list[bytes]] | None:
        """The answer's head arrived. A stream (SSE) gets a transform that forwards each chunk as it comes and
        keeps a copy; None: the transport holds the whole answer for `answer_body` (it is useless to the agent
        before it is complete)."""
        pending.status_code = status
        pending.t_first = time.perf_counter()
        pending.encoding = encoding
        pending.streamed = "text/event-stream" in content_type
        if not pending.streamed:
            return None
        pending.chunks = []
        return _SseRewriter(pending) if pending.added is not None and status < 400 else _collector(pending)

    def answer_body(self, pending: PendingTurn, body: bytes) -> bytes | None:
        """The whole answer: the turn is recorded before the agent has it. Returns the body the agent gets when
        lcap changed it (the vLLM path, without the fields lcap asked for), else None."""
        pending.response_body = body
        out = None
        if pending.added is not None and (pending.status_code or 500) < 400 and pending.encoding in (None, "identity"):
            try:
                answer = json.loads(body)
            except ValueError:
                answer = None
            if isinstance(answer, dict):
                out = json.dumps(dialects.strip_added(answer, pending.added), ensure_ascii=False).encode()
        self.close_call(pending)
        return out

    def close_call(self, pending: PendingTurn, error: str | None = None) -> None:
        """The call ended (a stream's end, or a failure with `error`): hand the turn to the writer."""
        if pending.done:
            return
        pending.done = True
        pending.t_end = time.perf_counter()
        if error is not None:
            pending.error = error
        self.writer.put(pending)
        with self._seq_lock:
            self.in_flight[pending.episode_id] -= 1


def with_route_model(request: dict, route: Route) -> dict:
    """A copy of `request` asking for the route's model (the deployment's), when the route names one."""
    forward = dict(request)
    if route.model:
        forward["model"] = route.model
    return forward


def _collector(pending: PendingTurn) -> Callable[[bytes], bytes]:
    """Forward each chunk as it comes, keeping a copy: the stream is never buffered."""
    chunks = pending.chunks
    assert chunks is not None

    def stream(data: bytes) -> bytes:
        if data:
            if not chunks:
                pending.t_first = time.perf_counter()
            chunks.append(data)
        return data

    return stream


class _SseRewriter:
    """vLLM path: forward each complete SSE event without the fields lcap asked for, keeping the original."""

    def __init__(self, pending: PendingTurn) -> None:
        self.pending = pending
        self.buffer = b""

    def __call__(self, data: bytes) -> list[bytes]:
        pending = self.pending
        assert pending.chunks is not None
        if data and not pending.chunks:
            pending.t_first = time.perf_counter()
        if data:
            pending.chunks.append(data)
        self.buffer += data
        if not data:  # end of stream: whatever is left goes out as it is
            rest, self.buffer = self.buffer, b""
            return [rest] if rest else []
        out = []
        while True:
            cut = self.buffer.find(b"\n\n")
            if cut < 0:
                break
            event, self.buffer = self.buffer[: cut + 2], self.buffer[cut + 2 :]
            out.append(self._rewrite(event))
        return out

    def _rewrite(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            assert self.pending.added is not None
            lines[i] = (
                b"data: "
                + json.dumps(
                    dialects.strip_added(obj, self.pending.added), ensure_ascii=False, separators=(",", ":")
                ).encode()
            )
        return b"\n".join(lines)
