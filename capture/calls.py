"""What lcap does with one LLM call, whichever listener carried it: attribute, reroute, record, finish.

Two transports drive these methods: the front's short path (capture/front.py) and the mitmproxy
addon (capture/addon.py) for everything the front hands over. Both speak in plain values (header
fields as byte pairs, bodies as bytes), so capture has one implementation. Everything here is
cheap: raw bytes and timings go on a `PendingTurn`, and the writer process does the parsing.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from lcap.capture import dialects
from lcap.capture.credentials import EpisodeKeys
from lcap.capture.redact import CREDENTIAL_HEADERS
from lcap.capture.turn import PendingTurn
from lcap.capture.writer import TurnWriter

log = logging.getLogger("lcap.capture")

Fields = Sequence[tuple[bytes, bytes]]  # header fields: (name, value) pairs
_CREDENTIALS = frozenset(name.encode() for name in CREDENTIAL_HEADERS)
# A rerouted call has nothing to switch protocols to, and an upgrade asked on a POST makes readers disagree on its
# body (llhttp, in uvicorn and Node, takes it for the next protocol's bytes): the request goes without it.
_UPGRADE = frozenset((b"upgrade", b"http2-settings"))


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
        """Map the agent's path onto the upstream: keep it whole, or graft what follows `/v1`. Bytes past ASCII
        (a raw 0xFF, unencoded UTF-8), which an HTTP/1 server may refuse (RFC 9112 3.2), are percent-encoded as
        browsers and curl send them; the turn keeps the path the agent wrote."""
        if not agent_path.isascii():
            agent_path = _PAST_ASCII.sub(_percent, agent_path.encode("utf-8", "surrogateescape")).decode()
        if not self.base_path:
            return agent_path
        path, sep, query = agent_path.partition("?")
        idx = path.find("/v1/")
        tail = path[idx + 3 :] if idx >= 0 else path
        return f"{self.base_path}{tail}{sep}{query}"


_PAST_ASCII = re.compile(rb"[\x80-\xff]")


def _percent(match: re.Match[bytes]) -> bytes:
    return b"%%%02X" % match[0][0]


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


class Unauthorized(Exception):
    """Credentials are required and the request proves no episode: the agent gets a 407."""


class NoRoute(Exception):
    """`--upstream` is set but has no server to send to right now (no policy record): the agent gets a 503,
    never the original host."""


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
        self,
        writer: TurnWriter,
        router: Router,
        *,
        token_ids: bool,
        upstream_api_key: str | None = None,
        keys: EpisodeKeys | None = None,
        require_credentials: bool = False,
        max_episodes: int = 100_000,
        max_body_bytes: int = 64 << 20,
    ) -> None:
        self.writer = writer
        self.router = router
        self.token_ids = token_ids
        self.upstream_api_key = upstream_api_key
        self.keys = keys or EpisodeKeys.new()
        self.require_credentials = require_credentials
        self.max_episodes = max_episodes
        self.max_body_bytes = max_body_bytes  # of a stream, the part kept for the turn
        # Per episode: the next seq, and calls numbered and not closed yet. An episode with nothing in flight
        # is idle; past `max_episodes` idle ones, the least recently used is forgotten. One that comes back
        # after that is numbered from `_floor`, above any seq a forgotten episode reached: its turns still sort.
        self._next: dict[str | None, int] = {}
        self.in_flight: dict[str | None, int] = {}
        self._idle: OrderedDict[str | None, None] = OrderedDict()
        self._floor = 0
        self._seq_lock = threading.Lock()
        self.numbered = 0  # calls numbered since the start

    def attribute(self, fields: Fields, fallback: str | None = None) -> tuple[str | None, Fields]:
        """The episode a request is written into (the one its credentials prove, else `fallback`: its tunnel's)
        and its fields without lcap's. `Unauthorized` when credentials are required and none proved one."""
        episode, _, fields = self.keys.take(fields)
        episode = episode or fallback
        if episode is None and self.require_credentials:
            raise Unauthorized
        return episode, fields

    def next_seq(self, episode: str | None) -> int:
        with self._seq_lock:
            seq = self._next.get(episode, self._floor)
            self._next[episode] = seq + 1
            self.numbered += 1
            running = self.in_flight.get(episode, 0)
            if not running:
                self._idle.pop(episode, None)
            self.in_flight[episode] = running + 1
        return seq

    def _closed(self, episode: str | None) -> None:
        with self._seq_lock:
            running = self.in_flight[episode] - 1
            if running:
                self.in_flight[episode] = running
                return
            del self.in_flight[episode]
            self._idle[episode] = None
            if len(self._idle) > self.max_episodes:
                forgotten, _ = self._idle.popitem(last=False)
                self._floor = max(self._floor, self._next.pop(forgotten))

    def counts(self) -> dict[str, int]:
        """Calls numbered so far and in flight, episodes tracked and with a call in flight (for `lcap status`)."""
        with self._seq_lock:
            return {
                "calls": self.numbered,
                "calls_in_flight": sum(self.in_flight.values()),
                "episodes": len(self._next),
                "episodes_in_flight": len(self.in_flight),
            }

    def tracked_episodes(self) -> int:
        """Episodes whose numbering is kept (in flight or idle): bounded by `max_episodes` plus those in flight."""
        return len(self._next)

    def busy(self, episode: str | None = None, *, any_episode: bool = False) -> bool:
        if any_episode:
            return bool(self.in_flight)
        return self.in_flight.get(episode, 0) > 0

    def open_call(
        self, dialect: str, episode: str | None, *, scheme: str, host: str, port: int, path: str, fields: Fields
    ) -> Call:
        """A request to an LLM path, from its head alone: its route, its header fields for that route, and a
        turn not recorded yet. Clients often write the body separately: this work is then done while it comes."""
        route = self.router.route()
        if route is None and self.router.upstream is not None:
            raise NoRoute(f"--upstream {self.router.upstream}: no server to send the call to")
        pending = PendingTurn(episode_id=episode, seq=None, host=host, path=path, dialect=dialect)
        call = Call(pending, route, scheme, host, port, path, fields)
        if route is None:
            pending.upstream = f"{scheme}://{host}:{port}"
            return call
        drop = _CREDENTIALS | _UPGRADE
        if self.token_ids and dialect in dialects.TOKEN_ID_DIALECTS:
            drop = drop | {b"accept-encoding"}  # answers are rewritten: keep them plain
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
            request, exact = json.loads(body), True
        except ValueError:
            request, exact = _read_leniently(body), False
        pending = call.pending
        if not dialects.looks_like_call(pending.dialect, request):
            return False
        pending.request_body = call.body = body
        pending.model_requested = request.get("model")
        if call.route is not None and exact:  # a body read leniently goes on as it came: the upstream judges it
            forward = with_route_model(request, call.route)
            if self.token_ids:
                pending.added = dialects.ask_token_ids(pending.dialect, forward)
                pending.token_ids = pending.added is not None
            if forward != request:
                call.body = json.dumps(forward, ensure_ascii=False).encode()
        pending.started_at, pending.t0 = time.time(), time.perf_counter()  # the call starts once it is whole
        pending.seq = self.next_seq(pending.episode_id)
        return True

    def refuse_call(self, call: Call, status: int, error: str) -> None:
        """A call refused before it was whole (a body past the limit): an error turn, numbered in its episode."""
        pending = call.pending
        pending.status_code = status
        pending.started_at, pending.t0 = time.time(), time.perf_counter()
        pending.seq = self.next_seq(pending.episode_id)
        self.close_call(pending, error)

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
        if pending.added is not None and status < 400:
            return _SseRewriter(pending, self.max_body_bytes)
        return _collector(pending, self.max_body_bytes)

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
        if pending.seq is not None:
            self._closed(pending.episode_id)


def _read_leniently(body: bytes) -> object:
    """A body Python's parser refuses but an upstream may take (bytes that are not UTF-8 in a string, a raw
    control character, an integer past `int`'s digit limit), read with those repaired; None if it is not JSON."""
    try:
        return json.loads(body.decode("utf-8", "replace"), strict=False, parse_int=_lenient_int)
    except (ValueError, RecursionError):
        return None


def _lenient_int(digits: str) -> int | float:
    return int(digits) if len(digits) < 4000 else float(digits)


def with_route_model(request: dict, route: Route) -> dict:
    """A copy of `request` asking for the route's model (the deployment's), when the route names one."""
    forward = dict(request)
    if route.model:
        forward["model"] = route.model
    return forward


class _Copy:
    """The turn's copy of a stream, its first `limit` bytes: past them the stream still flows to the agent whole, and
    the turn keeps its start and says it was cut."""

    __slots__ = ("kept", "limit", "pending")

    def __init__(self, pending: PendingTurn, limit: int) -> None:
        self.pending, self.limit, self.kept = pending, limit, 0

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


def _collector(pending: PendingTurn, limit: int) -> Callable[[bytes], bytes]:
    """Forward each chunk as it comes, keeping a copy: the stream is never buffered."""
    copy = _Copy(pending, limit)

    def stream(data: bytes) -> bytes:
        if data:
            copy.add(data)
        return data

    return stream


class _SseRewriter:
    """vLLM path: forward each complete SSE event without the fields lcap asked for, keeping the original."""

    def __init__(self, pending: PendingTurn, limit: int) -> None:
        self.pending = pending
        self.limit = limit
        self.copy = _Copy(pending, limit)
        self.buffer = b""

    def __call__(self, data: bytes) -> list[bytes]:
        if data:
            self.copy.add(data)
        self.buffer += data
        if not data or len(self.buffer) > self.limit:  # the end, or no event end in sight: out as it is
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
