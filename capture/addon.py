"""The mitmproxy addon: recognise LLM calls, reroute them, and hand finished turns to the writer.

One hook per concern, each cheap: the hooks record raw bytes and timings on a `PendingTurn` and
spool it when the call ends; all parsing of answers happens in the writer process. Every hook body
is wrapped: a capture bug is logged and the agent's traffic flows on untouched.
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
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from mitmproxy import http

from lcap.capture import dialects
from lcap.capture.redact import CREDENTIAL_HEADERS
from lcap.capture.turn import PendingTurn
from lcap.capture.writer import TurnWriter

log = logging.getLogger("lcap.capture")

EPISODE_HEADER = "x-lcap-episode"
_KEY = "lcap"
_WS_KEY = "lcap-ws"
_CREDENTIAL_NAMES = frozenset(name.encode() for name in CREDENTIAL_HEADERS)


def _guarded(hook: Callable) -> Callable:
    @functools.wraps(hook)
    def wrapper(self, *args):
        try:
            hook(self, *args)
        except Exception:
            log.exception("lcap: capture error in %s (traffic passed through)", hook.__name__)

    return wrapper


@dataclass(frozen=True)
class Route:
    """Where a recognised call goes instead of its original host."""

    scheme: str
    host: str
    port: int
    base_path: str          # e.g. "" or "/v1"
    model: str | None       # the model to ask for, or None to keep the agent's
    deployment: str | None  # the policy deployment name stored on the turn

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.base_path}"

    def path_for(self, agent_path: str) -> str:
        """Map the agent's path onto the upstream: keep it whole, or graft what follows `/v1`."""
        if not self.base_path:
            return agent_path
        path, sep, query = agent_path.partition("?")
        idx = path.find("/v1/")
        tail = path[idx + 3:] if idx >= 0 else path
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
        except (ValueError, TypeError) as exc:  # a record being rewritten: keep the last good route
            log.warning("lcap: unreadable policy record (%s); keeping the previous route", exc)
            return
        if record is None:
            self._policy_route = None
            return
        self._policy_route = parse_upstream(record.url, self.model or record.current, record.current)


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


class CaptureAddon:
    def __init__(self, writer: TurnWriter, router: Router, *, token_ids: bool,
                 upstream_api_key: str | None = None) -> None:
        self.writer = writer
        self.router = router
        self.token_ids = token_ids
        self.upstream_api_key = upstream_api_key
        self._conn_episode: dict[str, str] = {}
        self._seq: defaultdict[str | None, int] = defaultdict(int)
        self._seq_lock = threading.Lock()
        self.in_flight: defaultdict[str | None, int] = defaultdict(int)  # recognised calls not finished yet

    # --- attribution -------------------------------------------------------------------------

    def next_seq(self, episode: str | None) -> int:
        with self._seq_lock:
            seq = self._seq[episode]
            self._seq[episode] = seq + 1
            self.in_flight[episode] += 1
        return seq

    @_guarded
    def http_connect(self, flow: http.HTTPFlow) -> None:
        episode = episode_from_proxy_auth(flow.request.headers.get("proxy-authorization"))
        if episode:
            self._conn_episode[flow.client_conn.id] = episode

    @_guarded
    def client_disconnected(self, client) -> None:
        self._conn_episode.pop(client.id, None)

    def _episode(self, flow: http.HTTPFlow) -> str | None:
        """The episode a call belongs to; lcap's own headers are removed on the way (one pass over the fields)."""
        named = auth = None
        keep = []
        for field in flow.request.headers.fields:
            name = field[0].lower()
            if name == b"x-lcap-episode":
                named = field[1].decode("utf-8", "replace")
            elif name == b"proxy-authorization":
                auth = field[1].decode("latin-1")
            else:
                keep.append(field)
        if named is not None or auth is not None:
            flow.request.headers.fields = tuple(keep)
        return named or episode_from_proxy_auth(auth) or self._conn_episode.get(flow.client_conn.id)

    # --- requests ----------------------------------------------------------------------------

    @_guarded
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        episode = self._episode(flow)
        dialect = dialects.match(req.method, req.path)
        if dialect is not None:
            flow.metadata[_KEY] = PendingTurn(episode_id=episode, seq=None, host=req.host, path=req.path,
                                              dialect=dialect)
        elif req.method == "GET" and req.path.split("?", 1)[0].rstrip("/").endswith("/responses") \
                and req.headers.get("upgrade", "").lower() == "websocket":
            flow.metadata[_WS_KEY] = {"episode": episode, "turn": None, "host": req.host, "path": req.path,
                                      "route": None, "upstream": None}
        else:
            req.stream = True  # not an LLM call: passed through as it comes, never held in memory

    @_guarded
    def request(self, flow: http.HTTPFlow) -> None:
        pending: PendingTurn | None = flow.metadata.get(_KEY)
        if pending is None:
            if _WS_KEY in flow.metadata:
                self._route_websocket(flow)
            return
        req = flow.request
        raw = req.get_content(strict=False) or b""
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not dialects.looks_like_call(pending.dialect, body):
            del flow.metadata[_KEY]
            return
        pending.seq = self.next_seq(pending.episode_id)
        pending.request_body = raw
        pending.model_requested = body.get("model")
        route = self.router.route()
        if route is None:
            pending.upstream = f"{req.scheme}://{req.host}:{req.port}"
            return
        forward = dict(body)
        if route.model:
            forward["model"] = route.model
        if self.token_ids:
            pending.added = dialects.ask_token_ids(pending.dialect, forward)
            pending.token_ids = pending.added is not None
            if pending.added is not None:
                req.headers.pop("accept-encoding", None)  # answers are rewritten: keep them plain
        self._reroute(req, route)
        pending.upstream = route.url
        pending.deployment = route.deployment
        if forward != body:
            req.content = json.dumps(forward, ensure_ascii=False).encode()

    def _reroute(self, req: http.Request, route: Route) -> None:
        """Send the request to `route`, without the agent's credentials for its original host."""
        fields = tuple(f for f in req.headers.fields if f[0].lower() not in _CREDENTIAL_NAMES)
        if self.upstream_api_key:
            fields += ((b"authorization", f"Bearer {self.upstream_api_key}".encode()),)
        req.headers.fields = fields
        req.path = route.path_for(req.path)
        req.data.scheme, req.data.port = route.scheme.encode(), route.port
        req.host = route.host  # also rewrites the Host header

    # --- responses ---------------------------------------------------------------------------

    @_guarded
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """Streams (SSE) go to the agent chunk by chunk, copied on the way; a plain answer is held until it
        is complete (it is useless to the agent before), so its turn is spooled before the agent has it."""
        resp = flow.response
        if resp is None:
            return
        pending: PendingTurn | None = flow.metadata.get(_KEY)
        if pending is None:
            if _WS_KEY not in flow.metadata:
                resp.stream = True  # not an LLM call
            return
        pending.status_code = resp.status_code
        pending.t_first = time.perf_counter()
        pending.encoding = resp.headers.get("content-encoding")
        pending.streamed = "text/event-stream" in resp.headers.get("content-type", "")
        if not pending.streamed:
            return
        pending.chunks = []
        rewrite = pending.added is not None and resp.status_code < 400
        resp.stream = _SseRewriter(pending) if rewrite else _collector(pending)

    @_guarded
    def response(self, flow: http.HTTPFlow) -> None:
        pending: PendingTurn | None = flow.metadata.get(_KEY)
        if pending is None or pending.done or flow.response is None:
            return
        resp = flow.response
        pending.t_end = time.perf_counter()
        pending.status_code = resp.status_code
        if pending.chunks is None:  # held until complete: rewritten here, or decoded by the writer process
            if pending.added is not None and resp.status_code < 400:
                self._strip_added(resp, pending)
            else:
                pending.response_body = resp.raw_content or b""
        self._finish(pending)

    @staticmethod
    def _strip_added(resp: http.Response, pending: PendingTurn) -> None:
        """vLLM path: the agent gets the answer without the fields lcap asked for; the turn keeps them."""
        content = resp.get_content(strict=False) or b""
        pending.response_body, pending.encoding = content, None
        try:
            answer = json.loads(content)
        except ValueError:
            return
        if isinstance(answer, dict):
            resp.content = json.dumps(dialects.strip_added(answer, pending.added), ensure_ascii=False).encode()

    @_guarded
    def error(self, flow: http.HTTPFlow) -> None:
        pending: PendingTurn | None = flow.metadata.get(_KEY)
        if pending is not None and not pending.done:
            pending.t_end = time.perf_counter()
            pending.error = str(flow.error.msg if flow.error else "connection error")
            if flow.response is not None:
                pending.status_code = flow.response.status_code
            self._finish(pending)

    def _finish(self, pending: PendingTurn) -> None:
        pending.done = True
        if pending.t_end is None:
            pending.t_end = time.perf_counter()
        self.writer.put(pending)
        if pending.seq is not None:
            with self._seq_lock:
                self.in_flight[pending.episode_id] -= 1

    @staticmethod
    def owns(flow: http.HTTPFlow) -> bool:
        """Whether the call is a recognised LLM call that will become a turn."""
        return _KEY in flow.metadata

    def busy(self, episode: str | None = None, *, any_episode: bool = False) -> bool:
        if any_episode:
            return any(n > 0 for n in self.in_flight.values())
        return self.in_flight.get(episode, 0) > 0

    # --- Responses API over WebSocket ---------------------------------------------------------

    def _route_websocket(self, flow: http.HTTPFlow) -> None:
        state = flow.metadata[_WS_KEY]
        route = self.router.route()
        req = flow.request
        state["upstream"] = f"{req.scheme}://{req.host}:{req.port}"
        if route is not None:
            self._reroute(req, route)
            state["route"] = route
            state["upstream"] = route.url

    @_guarded
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        state = flow.metadata.get(_WS_KEY)
        if state is None or flow.websocket is None:
            return
        message = flow.websocket.messages[-1]
        if not message.is_text:
            return
        try:
            frame = json.loads(message.content)
        except ValueError:
            return
        if not isinstance(frame, dict):
            return
        kind = frame.get("type")
        if message.from_client:
            if kind != "response.create":
                return
            request = frame.get("response") if isinstance(frame.get("response"), dict) else frame
            route: Route | None = state["route"]
            if route is not None and route.model and request.get("model") != route.model:
                forward = json.loads(message.content)
                target = forward.get("response") if isinstance(forward.get("response"), dict) else forward
                target["model"] = route.model
                message.content = json.dumps(forward, ensure_ascii=False).encode()
            if frame.get("generate") is False:  # a warm-up frame: no model output, no turn
                return
            self._ws_close_turn(state, "superseded by a new response.create")
            turn = PendingTurn(episode_id=state["episode"], seq=self.next_seq(state["episode"]), host=state["host"],
                               path=state["path"], dialect=dialects.RESPONSES, transport="websocket")
            turn.request_json = frame
            turn.model_requested = request.get("model")
            turn.upstream = state["upstream"]
            turn.deployment = route.deployment if route is not None else None
            turn.streamed = True
            turn.events = []
            state["turn"] = turn
            return
        turn: PendingTurn | None = state["turn"]
        if turn is None:
            return
        if turn.t_first is None:
            turn.t_first = time.perf_counter()
        turn.events.append(frame)
        if kind in ("response.completed", "response.incomplete", "response.failed", "error"):
            turn.status_code = 200 if kind != "error" else None
            turn.t_end = time.perf_counter()
            state["turn"] = None
            self._finish(turn)

    @_guarded
    def websocket_end(self, flow: http.HTTPFlow) -> None:
        state = flow.metadata.get(_WS_KEY)
        if state is not None:
            self._ws_close_turn(state, "websocket closed before the response completed")

    def _ws_close_turn(self, state: dict, why: str) -> None:
        turn: PendingTurn | None = state["turn"]
        if turn is not None and not turn.done:
            turn.t_end = time.perf_counter()
            turn.error = why
            state["turn"] = None
            self._finish(turn)


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
            event, self.buffer = self.buffer[:cut + 2], self.buffer[cut + 2:]
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
            lines[i] = b"data: " + json.dumps(dialects.strip_added(obj, self.pending.added),
                                              ensure_ascii=False, separators=(",", ":")).encode()
        return b"\n".join(lines)

