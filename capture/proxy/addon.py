"""The mitmproxy addon: LLM calls the front handed over (capture/proxy/front.py) become turns here.

The hooks map mitmproxy flows onto `Calls` (capture/proxy/calls.py), which both transports share, and
capture the Responses API over WebSocket, which only mitmproxy carries. Every hook body is
wrapped: a capture bug is logged and the agent's traffic flows on untouched.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from mitmproxy import http
from wsproto.frame_protocol import CloseReason

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.calls import Calls, with_route_model
from lcap.capture.proxy.mitm_guards import connection_of, cut_upstream
from lcap.capture.proxy.refusals import AnswerRefused, BodyRefused, HoldRefused, NoRoute, Unauthorized
from lcap.capture.routing import policy_wire
from lcap.capture.routing.routes import Route
from lcap.capture.turns import dialects
from lcap.capture.turns.turn import PendingTurn, agent_left

log = logging.getLogger("lcap.capture")

_OPEN = "lcap-open"  # (dialect, episode) of a request on an LLM path, until its body is read
_KEY = "lcap"  # the PendingTurn of a recognised call
_WS_KEY = "lcap-ws"
_TIMER = "lcap-timer"  # the call's upstream deadline (a loop timer)
_TIMED_OUT = "lcap-timed-out"  # why the deadline cut the call
MAX_ERROR_CHARS = 1000  # of an error mitmproxy reports, kept in the turn


def _guarded(hook: Callable) -> Callable:
    @functools.wraps(hook)
    def wrapper(self, *args):
        try:
            hook(self, *args)
        except Exception:
            log.exception("lcap: capture error in %s (traffic passed through)", hook.__name__)

    return wrapper


class CaptureAddon:
    def __init__(
        self, calls: Calls, options: ProxyOptions, proxyserver: Any, front_episode: Callable[[Any], str | None]
    ) -> None:
        self.calls = calls
        self.options = options
        self.proxyserver = proxyserver  # mitmproxy's, to cut the server connection of a call past its deadline
        self.front_episode = front_episode  # the episode the front knows a connection it handed over belongs to
        self._conn_episode: dict[str, str | None] = {}  # per open tunnel, dropped when its client disconnects

    # --- attribution -------------------------------------------------------------------------

    @_guarded
    def http_connect(self, flow: http.HTTPFlow) -> None:
        try:
            episode, _, _ = self.calls.attribute(flow.request.headers.fields, self.front_episode(flow.client_conn))
        except Unauthorized:  # the front answers these itself: only a connection that bypassed it gets here
            flow.response = http.Response.make(407, b"lcap: episode credentials required\n", _AUTHENTICATE)
            return
        self._conn_episode[flow.client_conn.id] = episode

    @_guarded
    def client_disconnected(self, client) -> None:
        self._conn_episode.pop(client.id, None)

    # --- requests ----------------------------------------------------------------------------

    @_guarded
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        try:
            conn = flow.client_conn
            fallback = self._conn_episode[conn.id] if conn.id in self._conn_episode else self.front_episode(conn)
            episode, role, fields = self.calls.attribute(req.headers.fields, fallback)
        except Unauthorized:
            log.warning("lcap: a request without episode credentials on a handed-off connection was cut off")
            flow.kill()
            return
        if fields is not req.headers.fields:
            req.headers.fields = tuple(fields)
        dialect = dialects.match(req.method, req.path)
        if dialect is not None:
            flow.metadata[_OPEN] = (dialect, episode, role)
        elif (
            req.method == "GET"
            and req.path.split("?", 1)[0].rstrip("/").endswith("/responses")
            and req.headers.get("upgrade", "").lower() == "websocket"
        ):
            flow.metadata[_WS_KEY] = {
                "episode": episode,
                "role": role,  # its X-Lcap-Role header's; each response.create's role is decided from it
                "turn": None,
                "host": req.host,
                "path": req.path,
                "route": None,
                "upstream": None,
            }
        else:
            req.stream = True  # not an LLM call: passed through as it comes, never held in memory

    async def request(self, flow: http.HTTPFlow) -> None:
        """An LLM path's request is whole. Not guarded like the other hooks: when lcap reroutes, a failure here
        answers the agent (502, 503) instead of letting the call go to its original host with its key. A call
        for the policy while every replica restarts waits here (`Calls.hold`), as does a Responses WebSocket's
        opening; mitmproxy goes on with the connection's other flows meanwhile."""
        try:
            await self._request(flow)
        except (NoRoute, HoldRefused) as exc:  # a held call's turn is stored and counted already
            flow.response = http.Response.make(503, f"lcap: {exc}\n".encode())
        except BodyRefused as exc:  # its turn is stored already
            flow.response = http.Response.make(exc.status, f"lcap: {exc}\n".encode())
        except Exception:
            log.exception("lcap: capture error in request")
            if self.calls.routed and dialects.match(flow.request.method, flow.request.path):
                flow.response = http.Response.make(502, b"lcap: capture error (see lcap's log)\n")

    async def _request(self, flow: http.HTTPFlow) -> None:
        opened = flow.metadata.pop(_OPEN, None)
        if opened is None:
            if _WS_KEY in flow.metadata:
                if not await self.calls.hold_websocket(lambda: not flow.client_conn.connected):
                    flow.kill()  # the agent left while its WebSocket's opening was held
                    return
                self._route_websocket(flow)
            return
        req = flow.request
        body = req.raw_content or b""  # as it came: `Calls` decodes it within the limit, never mitmproxy
        call = self.calls.open_call(
            *opened, scheme=req.scheme, host=req.host, port=req.port, path=req.path, fields=req.headers.fields
        )  # here, not at requestheaders: mitmproxy may change them
        plain = await self.calls.read_body(call, body, req.headers.get("content-encoding"))
        is_call = self.calls.take_body(call, plain)
        if is_call and self.calls.must_hold(call):
            try:
                ready = await self.calls.hold(call, lambda: not flow.client_conn.connected)
            except asyncio.CancelledError:  # the proxy stops
                self.calls.close_call(call.pending, "the call was interrupted")
                raise
            if not ready:  # the agent left while its call was held
                self.calls.close_call(call.pending, agent_left(False))
                flow.kill()
                return
        if is_call:
            flow.metadata[_KEY] = call.pending
            self._arm(flow, self.options.first_byte_timeout, "no answer within {:g} s (--first-byte-timeout)")
        if call.route is not None:
            req.headers.fields = tuple(call.fields)  # a side call too goes to the route, never to the original host
            if (call.scheme, call.host, call.port, call.path) != (req.scheme, req.host, req.port, req.path):
                _retarget(req, call.scheme, call.host, call.port, call.path)
        if is_call and call.body is not body:
            req.content = call.body  # after the fields: a body lcap rewrote goes plain, its Content-Encoding dropped

    # --- responses ---------------------------------------------------------------------------

    @_guarded
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        resp = flow.response
        if resp is None:
            return
        pending: PendingTurn | None = flow.metadata.get(_KEY)
        if pending is None:
            if _WS_KEY not in flow.metadata:
                resp.stream = True  # not an LLM call
            return
        transform = self.calls.answer_head(
            pending, resp.status_code, resp.headers.get("content-type", ""), resp.headers.get("content-encoding")
        )
        idle = self.options.stream_idle_timeout
        self._arm(flow, idle, "silent for {:g} s in the middle of its answer (--stream-idle-timeout)")
        if transform is not None:
            resp.stream = self._watched(flow, transform, idle)

    def _watched(self, flow: http.HTTPFlow, transform: Callable, idle: float) -> Callable:
        def stream(data: bytes) -> Any:
            self._arm(flow, idle, "silent for {:g} s in the middle of its answer (--stream-idle-timeout)")
            return transform(data)

        return stream

    async def response(self, flow: http.HTTPFlow) -> None:
        """A whole answer (or a stream's end). Not guarded like the other hooks: an answer lcap must rewrite and
        cannot read gets a 502 (`AnswerRefused`, its turn stored)."""
        try:
            await self._response(flow)
        except AnswerRefused as exc:
            flow.response = http.Response.make(502, f"lcap: {exc}\n".encode())
        except Exception:
            log.exception("lcap: capture error in response (traffic passed through)")

    async def _response(self, flow: http.HTTPFlow) -> None:
        self._disarm(flow)
        if flow.websocket is not None and _WS_KEY not in flow.metadata:
            flow.websocket = None  # not an LLM call: relayed as plain TCP, never a whole message held in memory
        pending: PendingTurn | None = flow.metadata.get(_KEY)
        if pending is None or pending.done or flow.response is None:
            return
        if pending.chunks is not None:  # a stream: the agent has it all already
            self.calls.close_call(pending)
            return
        raw = flow.response.raw_content or b""
        plain = await self.calls.read_answer(pending, raw)
        out = self.calls.answer_body(pending, plain) or plain
        if out is not raw:  # lcap decoded or rewrote it: the agent gets it plain
            flow.response.headers.pop("content-encoding", None)
            flow.response.content = out

    @_guarded
    def tcp_message(self, flow: Any) -> None:
        flow.messages.clear()  # relayed already: what a tunnel carried is nobody's to keep

    @_guarded
    def error(self, flow: http.HTTPFlow) -> None:
        self._disarm(flow)
        opened = flow.metadata.pop(_OPEN, None)
        message = str(flow.error.msg if flow.error else "connection error")
        if len(message) > MAX_ERROR_CHARS:  # mitmproxy's errors may quote what an upstream sent
            message = message[:MAX_ERROR_CHARS] + " [...]"
        if opened is not None and message.startswith("lcap: request body over"):  # install_body_limits' 413
            req = flow.request
            call = self.calls.open_call(
                *opened, scheme=req.scheme, host=req.host, port=req.port, path=req.path, fields=req.headers.fields
            )
            self.calls.refuse_call(call, 413, message.removeprefix("lcap: "))
            return
        pending: PendingTurn | None = flow.metadata.get(_KEY)
        if pending is not None and not pending.done:
            if flow.response is not None:
                pending.status_code = flow.response.status_code
            if message == "Client disconnected.":  # in the front's words, so both transports read alike
                message = agent_left(flow.response is not None)
            else:
                self.calls.failed(pending, message)
            self.calls.close_call(pending, flow.metadata.pop(_TIMED_OUT, None) or message)

    def body_limit(self, flow: http.HTTPFlow, request: bool) -> int | None:
        """The largest body mitmproxy may hold for `flow` (`install_body_limits`): LLM requests, and the answers
        of recorded calls unless streamed; None for the rest, which streams."""
        if request:
            return self.options.max_body_bytes if dialects.match(flow.request.method, flow.request.path) else None
        if _KEY not in flow.metadata or flow.response is None:
            return None
        streamed = "text/event-stream" in flow.response.headers.get("content-type", "")
        return None if streamed else self.options.max_body_bytes

    # --- upstream deadlines ----------------------------------------------------------------------

    def _arm(self, flow: http.HTTPFlow, seconds: float, why: str) -> None:
        """(Re)start the call's deadline: past it, its server connection is cut and the turn says `why`."""
        self._disarm(flow)
        flow.metadata[_TIMER] = asyncio.get_running_loop().call_later(seconds, self._expire, flow, why.format(seconds))

    def _disarm(self, flow: http.HTTPFlow) -> None:
        timer = flow.metadata.pop(_TIMER, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, flow: http.HTTPFlow, why: str) -> None:
        flow.metadata.pop(_TIMER, None)
        pending: PendingTurn | None = flow.metadata.get(_KEY)
        handler = connection_of(self.proxyserver, flow)
        if pending is None or pending.done or handler is None:
            return
        flow.metadata[_TIMED_OUT] = f"upstream {pending.upstream}: {why}"
        cut_upstream(handler, flow)  # mitmproxy answers 502 and calls `error`

    # --- Responses API over WebSocket ---------------------------------------------------------

    def _route_websocket(self, flow: http.HTTPFlow) -> None:
        state = flow.metadata[_WS_KEY]
        route = self.calls.route_for(state["episode"], state["role"])
        req = flow.request
        state["upstream"] = f"{req.scheme}://{req.host}:{req.port}"
        if route is not None:
            req.headers.fields = tuple(self.calls.rerouted_fields(req.headers.fields, route))
            path = policy_wire.PATHS[dialects.RESPONSES] if route.lcap else route.path_for(req.path)
            _retarget(req, route.scheme, route.host, route.port, path)
            state["route"] = route
            state["upstream"] = route.url

    @_guarded
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        if flow.websocket is None:
            return
        try:
            self._ws_message(flow, flow.websocket.messages[-1])
        finally:  # mitmproxy relays the message itself: the flow need not keep every message until the socket closes
            flow.websocket.messages.clear()

    def _ws_message(self, flow: http.HTTPFlow, message: Any) -> None:
        state = flow.metadata.get(_WS_KEY)
        if state is None or not message.is_text:
            return
        turn: PendingTurn | None = state["turn"]
        if not message.from_client and turn is not None and turn.policy:
            part = policy_wire.frame_part(message.content)
            if part is not None:  # lcap's record or head: the agent never sees them
                self.calls.policy_parts(turn, *part)
                message.drop()
                return
        try:
            frame = json.loads(message.content)
        except ValueError:
            return
        if not isinstance(frame, dict):
            return
        kind = frame.get("type")
        if message.from_client:
            if kind == "response.create":
                self._ws_request(state, message, frame)
            return
        if turn is None:
            return
        if turn.t_first is None:
            turn.t_first = time.perf_counter()
        if turn.events is not None:
            state["kept"] += len(message.content)
            if state["kept"] <= self.options.max_body_bytes:
                turn.events.append(frame)
            elif turn.error is None:
                limit = self.options.max_body_bytes
                turn.error = f"capture: a stream over {limit} bytes (--max-body-bytes); the turn has its start"
        if kind in ("response.completed", "response.incomplete", "response.failed", "error"):
            turn.status_code = 200 if kind != "error" else _error_status(frame)
            state["turn"] = None
            self.calls.close_call(turn)

    def _ws_request(self, state: dict, message: Any, frame: dict) -> None:
        """A `response.create` frame: a new turn (unless it only warms the connection up), and the frame as the
        route wants it (the deployment's model; on lcap's endpoints, lcap's options and the conversation's head)."""
        nested = frame.get("response")
        request: dict = nested if isinstance(nested, dict) else frame
        warm_up = frame.get("generate") is False  # no model output, no turn
        # A warm-up is no call: it opens no conversation of the episode (--role-by thread) and keeps the socket's route
        role = None if warm_up else self.calls.roles.of(state["role"], request, state["episode"], dialects.RESPONSES)
        route = self._role_route(state, role)
        if not warm_up:
            self._ws_close_turn(state, "superseded by a new response.create")
        started = self._ws_turn(state, numbered=not warm_up)
        started.policy = route is not None and route.lcap
        if route is not None:
            forward = with_route_model(request, route)
            outer = {**frame, "response": forward} if request is not frame else forward
            if started.policy:
                message.content = self.calls.policy_request(started, request, outer, stitch=not warm_up)
            elif forward != request:
                message.content = json.dumps(outer, ensure_ascii=False).encode()
        if warm_up:
            return
        started.request_json = frame
        started.role = role
        started.model_requested = request.get("model")
        started.upstream = state["upstream"]
        started.deployment = route.deployment if route is not None else None
        started.replica = route.replica if route is not None else None
        started.streamed = True
        started.events = []
        state["turn"] = started
        state["kept"] = 0

    def _role_route(self, state: dict, role: str | None) -> Route | None:
        """The route of one `response.create` of `role`: on the policy, its role's adapter on the replica the socket
        is open to (each frame names its model); elsewhere, or without a role, the socket's own route."""
        route: Route | None = state["route"]
        if route is None or route.replica is None or role is None:
            return route
        try:
            own = self.calls.route_for(state["episode"], role)
        except NoRoute:
            return route
        return own if own is not None and own.replica == route.replica else route

    @_guarded
    def websocket_end(self, flow: http.HTTPFlow) -> None:
        state = flow.metadata.get(_WS_KEY)
        if state is None:
            return
        ws = flow.websocket
        reason = (ws.close_reason or "") if ws is not None else ""
        if ws is not None and ws.close_code == CloseReason.MESSAGE_TOO_BIG and reason.startswith("lcap:"):
            why = reason.removeprefix("lcap: ") + "; lcap closed the WebSocket (1009)"
            log.warning("lcap: a Responses WebSocket of episode %s was closed: %s", state["episode"], why)
            if state["turn"] is None or ws.closed_by_client:  # the message refused is a call of its own
                self._ws_close_turn(state, "superseded by a message lcap refused")
                state["turn"] = self._ws_turn(state)
            self._ws_close_turn(state, why)
            return
        self._ws_close_turn(state, "websocket closed before the response completed")

    def _ws_turn(self, state: dict, *, numbered: bool = True) -> PendingTurn:
        return PendingTurn(
            episode_id=state["episode"],
            seq=self.calls.next_seq(state["episode"]) if numbered else None,
            host=state["host"],
            path=state["path"],
            dialect=dialects.RESPONSES,
            transport="websocket",
        )

    def _ws_close_turn(self, state: dict, why: str) -> None:
        turn: PendingTurn | None = state["turn"]
        if turn is not None and not turn.done:
            state["turn"] = None
            self.calls.close_call(turn, why)


_AUTHENTICATE = {"proxy-authenticate": 'Basic realm="lcap"'}


def _error_status(event: dict) -> int | None:
    """The HTTP status a Responses WebSocket `error` event carries (the same call's status over HTTP), if any."""
    status = event.get("status")
    return status if type(status) is int and 400 <= status < 600 else None


def _retarget(req: http.Request, scheme: str, host: str, port: int, path: str) -> None:
    req.scheme, req.port, req.path = scheme, port, path
    req.host = host  # after scheme and port: it rewrites the Host header (or HTTP/2 authority) too
