"""What lcap does with one LLM call, whichever listener carried it: attribute, reroute, record, finish.

Two transports drive these methods: the front's short path (capture/proxy/front.py) and the mitmproxy
addon (capture/proxy/addon.py) for everything the front hands over. Both speak in plain values (header
fields as byte pairs, bodies as bytes), so capture has one implementation. Everything here is
cheap: raw bytes and timings go on a `PendingTurn`, and the writer process does the parsing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from lcap.capture.proxy.refusals import AnswerRefused, BodyRefused, HoldRefused, NoRoute, Unauthorized
from lcap.capture.proxy.roles import RoleRule, Roles, take_role_header
from lcap.capture.proxy.sessions import Sessions, is_session_episode, tenant_of
from lcap.capture.proxy.streams import PolicyStream, SseRewriter, StreamCopy
from lcap.capture.routing import policy_wire
from lcap.capture.routing.routes import Route, Router
from lcap.capture.routing.stitching import ConversationHeads, Head
from lcap.capture.storage.writer import TurnSink
from lcap.capture.trust.credentials import EpisodeKeys, HeaderFields
from lcap.capture.trust.redact import CREDENTIAL_HEADERS
from lcap.capture.turns import dialects, encoding
from lcap.capture.turns.turn import PendingTurn

log = logging.getLogger("lcap.capture")

_CREDENTIALS = frozenset(name.encode() for name in CREDENTIAL_HEADERS)
# A rerouted call has nothing to switch protocols to, and an upgrade asked on a POST makes readers disagree on its
# body (llhttp, in uvicorn and Node, takes it for the next protocol's bytes): the request goes without it.
_UPGRADE = frozenset((b"upgrade", b"http2-settings"))
HOLD_POLL_S = 0.25  # how often a held call looks whether a replica serves again, or its agent left


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
    fields: HeaderFields  # the request's header fields, minus lcap's own (and the agent's credentials when rerouted)
    agent_fields: HeaderFields = ()  # the fields as the agent sent them (minus lcap's): a failover reroutes from these
    body: bytes = b""  # the request body to send (rewritten when lcap changed it)
    raw: bytes = b""  # the request body as the agent sent it
    encoding: str | None = None  # the request body's Content-Encoding, when lcap decoded it to read it
    request: Any = None  # the request body, decoded (an LLM call's)
    tried: frozenset[str] = frozenset()  # replicas this call failed to reach
    held_until: float | None = None  # the end of the call's hold (time.monotonic()), once it was first held


class Calls:
    """Attribution, rerouting and recording of LLM calls: all that the two transports, the front
    (capture/proxy/front.py, exchange.py) and the mitmproxy addon (capture/proxy/addon.py), ask of capture. They
    use these methods only, never the `router` or the stitching `heads` behind them.

    A call over HTTP, in order: `attribute` (the episode its head proves), `open_call` (its route and its turn),
    `read_body` then `take_body` (an LLM call, numbered and recorded from here on, or a side call sent on as it
    came), `must_hold` and `hold` (while every policy replica restarts), `failover` (its replica never answered),
    `answer_head` (a stream's transform, or None), then `read_answer` and `answer_body` (a whole answer) or
    `close_call` (a stream's end, or a failure). `failed`: the upstream broke the call (its replica leaves the
    rotation); `refuse_call`: lcap refused the call before it was whole; `routed`: `--upstream` sends calls away
    from their own host.

    A Responses WebSocket (the addon only): `hold_websocket`, `route_for`, `rerouted_fields`, `next_seq` (a turn
    per `response.create`), `policy_request` and `policy_parts` (lcap's endpoints), `close_call`.

    The proxy that owns it (capture/proxy/server.py): `counts`, `busy`, `forget` (an episode ended)."""

    def __init__(
        self,
        writer: TurnSink,
        router: Router,
        *,
        token_ids: bool,
        upstream_api_key: str | None = None,
        keys: EpisodeKeys | None = None,
        require_credentials: bool = False,
        max_episodes: int = 100_000,
        max_body_bytes: int = 64 << 20,
        stitch: bool = True,
        adapt: bool = True,
        temperature: float | None = None,
        heads: ConversationHeads | None = None,
        hold_timeout: float = 600.0,
        max_held: int = 512,
        sessions: Sessions | None = None,
        session_floor: int = 0,
        role_by: tuple[RoleRule, ...] = (),
    ) -> None:
        self.writer = writer
        self.router = router
        self.token_ids = token_ids
        self.stitch, self.adapt, self.temperature = stitch, adapt, temperature
        self.heads = heads if heads is not None else ConversationHeads(256 << 20)
        self.upstream_api_key = upstream_api_key
        self.keys = keys or EpisodeKeys.new()
        self.require_credentials = require_credentials
        self.sessions = sessions
        self.max_episodes = max_episodes
        self.max_body_bytes = max_body_bytes  # of a stream, the part kept for the turn
        # Per episode: the next seq, and calls numbered and not closed yet. An episode with nothing in flight
        # is idle; past `max_episodes` idle ones, the least recently used is forgotten. One that comes back
        # after that is numbered from `_floor`, above any seq a forgotten episode reached: its turns still sort.
        self._next: dict[str | None, int] = {}
        self.in_flight: dict[str | None, int] = {}
        self._idle: OrderedDict[str | None, None] = OrderedDict()
        self._floor = 0
        self.session_floor = session_floor  # a header session's first seq here: above an earlier run's (a restart)
        self.roles = Roles(role_by)  # --role-by: the rules a call without an X-Lcap-Role header takes its role from
        self._seq_lock = threading.Lock()
        self.numbered = 0  # calls numbered since the start
        self.hold_timeout, self.max_held = hold_timeout, max_held
        self.held = 0  # calls waiting now for a restarting replica (`hold`); changed on the proxy's loop only
        self.hold_refused = 0  # held calls answered 503 since the start (timeout, or past `max_held`)

    @property
    def routed(self) -> bool:
        """Whether `--upstream` sends calls elsewhere than to their own host."""
        return self.router.upstream is not None

    def failed(self, pending: PendingTurn, why: str) -> None:
        """The upstream failed `pending`'s call (no answer, a broken connection, past a deadline): its policy
        replica, if it has one, leaves the rotation until a probe finds it serving again."""
        self.router.failed(pending.replica, why)

    def forget(self, episode: str) -> None:
        """`episode` ended and makes no more calls: the stitching heads its calls left would only crowd out live
        episodes' heads."""
        self.heads.forget(episode)
        self.roles.forget(episode)

    def attribute(
        self, fields: HeaderFields, fallback: str | None = None
    ) -> tuple[str | None, str | None, HeaderFields]:
        """The episode a request is written into (the one its credentials prove, else `fallback`: its tunnel's),
        the role its `X-Lcap-Role` header names (capture/proxy/roles.py) and its fields without lcap's.
        `Unauthorized` when credentials are required and none proved one. Without credentials, a session header
        names the episode (capture/proxy/sessions.py)."""
        role, fields = take_role_header(fields)
        episode, _, fields = self.keys.take(fields)
        episode = episode or fallback
        if self.sessions is not None:
            session, fields = self.sessions.take_header(fields)
            if episode is None and session is not None and not self.require_credentials:
                episode = self.sessions.by_header(session, fields)
        if episode is None and self.require_credentials:
            raise Unauthorized
        return episode, role, fields

    def next_seq(self, episode: str | None) -> int:
        with self._seq_lock:
            first = max(self._floor, self.session_floor) if is_session_episode(episode) else self._floor
            seq = self._next.get(episode, first)
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
                "calls_held": self.held,
                "calls_hold_refused": self.hold_refused,
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
        self,
        dialect: str,
        episode: str | None,
        role: str | None = None,
        *,
        scheme: str,
        host: str,
        port: int,
        path: str,
        fields: HeaderFields,
    ) -> Call:
        """A request to an LLM path, from its head alone: its route, its header fields for that route, and a
        turn not recorded yet (`role`: its header's, which `take_body` keeps over the --role-by rules). Clients
        often write the body separately: this work is then done while it comes."""
        route = self.route_for(episode, role)
        pending = PendingTurn(episode_id=episode, seq=None, host=host, path=path, dialect=dialect)
        pending.body_limit = self.max_body_bytes
        pending.role = role
        call = Call(pending, route, scheme, host, port, path, fields, fields)
        if route is None:
            pending.upstream = f"{scheme}://{host}:{port}"
        else:
            self._point(call, route)
        return call

    def route_for(self, episode: str | None, role: str | None = None) -> Route | None:
        """Where `episode`'s call of `role` goes: None to its own host; `NoRoute` when `--upstream` has no server now."""
        route = self.router.route(episode, role=role)
        if route is None and self.router.upstream is not None:
            raise NoRoute(f"--upstream {self.router.upstream}: no server to send the call to")
        return route

    def _point(self, call: Call, route: Route) -> None:
        """Send `call` along `route`: its upstream, its fields for that upstream, and what its turn says of it."""
        pending = call.pending
        pending.policy = route.lcap and pending.dialect in policy_wire.PATHS
        drop = _CREDENTIALS | _UPGRADE
        if pending.policy or (self.token_ids and pending.dialect in dialects.TOKEN_ID_DIALECTS):
            drop = drop | {b"accept-encoding"}  # answers are rewritten: keep them plain
        call.route = route
        call.fields = self.rerouted_fields(call.agent_fields, route, drop)
        call.scheme, call.host, call.port = route.scheme, route.host, route.port
        call.path = policy_wire.PATHS[pending.dialect] if pending.policy else route.path_for(call.path)
        pending.upstream, pending.deployment, pending.replica = route.url, route.deployment, route.replica

    def failover(self, call: Call, why: str) -> bool:
        """The call could not reach its replica (no connection, or closed before any answer): that replica leaves
        the rotation and the call goes to the episode's next one. False when there is no other to try."""
        route = call.route
        if route is None or route.replica is None:
            return False
        self.router.failed(route.replica, why)
        call.tried = call.tried | {route.replica}
        other = self.router.route(call.pending.episode_id, call.tried, call.pending.role)
        if other is None:
            return False
        self._repoint(call, other)
        return True

    def _repoint(self, call: Call, route: Route) -> None:
        """Send a whole call along another route: re-rendered when that replica serves another deployment."""
        previous = call.route
        call.path = call.pending.path
        self._point(call, route)
        if call.request is not None and (previous is None or route.model != previous.model):
            call.body = self._forward(call)
        self._plain_fields(call)

    def must_hold(self, call: Call) -> bool:
        """Whether a whole call for the policy must wait before it is sent: every replica is restarting."""
        return call.route is not None and call.route.replica is not None and self.router.holding()

    async def hold(self, call: Call, gone: Callable[[], bool]) -> bool:
        """Keep a call while every policy replica restarts (serve/deploy.py marks them draining), then point it at
        the replica that serves again: the deployment it serves now is the one the turn stores. The call's hold
        lasts `hold_timeout` at most, however often it is held. False when the agent left (`gone()`, looked at
        every HOLD_POLL_S); `HoldRefused` past the timeout, past `max_held` calls held at once, or when the policy
        record went away meanwhile (the turn is then stored with the error, and counted)."""
        if call.held_until is None:
            call.held_until = time.monotonic() + self.hold_timeout
        refuse = functools.partial(self._refuse_held, call)
        route = await self._wait_for_a_replica(call.held_until, gone, refuse, call.pending)
        if route is None:
            return False
        call.tried = frozenset()  # the replicas it failed on have restarted
        self._repoint(call, route)
        return True

    async def hold_websocket(self, gone: Callable[[], bool]) -> bool:
        """Keep a Responses WebSocket's opening while every policy replica restarts, as `hold` keeps a call, so that
        it opens on the replica that serves again (one open before goes on with its replica: it cannot move).
        True at once when they are not all restarting; False when the agent left; `HoldRefused` as `hold` (no
        turn began: the refusal is counted and logged)."""
        if not self.router.holding():
            return True
        deadline = time.monotonic() + self.hold_timeout
        return await self._wait_for_a_replica(deadline, gone, self._refuse_websocket) is not None

    async def _wait_for_a_replica(
        self,
        deadline: float,
        gone: Callable[[], bool],
        refuse: Callable[[str], NoReturn],
        call: PendingTurn | None = None,
    ) -> Route | None:
        """Wait while the router holds, until `deadline`: the route `call` then takes (its episode's replica, its
        role's deployment), or None when the agent left; `refuse` says why a wait ends without a replica."""
        if self.held >= self.max_held:
            refuse(f"too many calls wait for a restarting policy replica (--max-held-calls {self.max_held})")
        self.held += 1
        try:
            while self.router.holding() and not gone():
                left = deadline - time.monotonic()
                if left <= 0:
                    refuse(f"no policy replica served again within {self.hold_timeout:g} s (--hold-timeout)")
                await asyncio.sleep(min(HOLD_POLL_S, left))
        finally:
            self.held -= 1
        if gone():
            return None
        route = self.router.route(call.episode_id, role=call.role) if call is not None else self.router.route()
        if route is None:
            refuse(f"--upstream {self.router.upstream}: the policy server went away meanwhile")
        return route

    def _refuse_held(self, call: Call, why: str) -> NoReturn:
        self.hold_refused += 1
        log.warning("lcap: a call of episode %s got a 503: %s", call.pending.episode_id, why)
        call.pending.status_code = 503
        self.close_call(call.pending, why)
        raise HoldRefused(why)

    def _refuse_websocket(self, why: str) -> NoReturn:
        self.hold_refused += 1
        log.warning("lcap: a Responses WebSocket got a 503: %s", why)
        raise HoldRefused(why)

    async def read_body(self, call: Call, body: bytes, content_encoding: str | None) -> bytes:
        """The request's body as it came, decoded by its `content_encoding` for `take_body` to read (an unknown
        coding is left to the upstream: returned as it is). The inflate runs off the event loop and stops at
        `max_body_bytes`: past it a `BodyRefused` 413, and a body that is not what its coding says a 400 (each
        with its turn stored, the body kept as it came)."""
        call.raw = body
        if not (encoding.encoded(content_encoding) and encoding.known(content_encoding)):
            return body
        try:
            plain = await asyncio.to_thread(encoding.decode_body, body, content_encoding, self.max_body_bytes)
        except (encoding.BodyTooLarge, encoding.UndecodableBody) as exc:
            status = 413 if isinstance(exc, encoding.BodyTooLarge) else 400
            why = f"request body: {exc}"
            call.pending.request_body, call.pending.request_encoding = body, content_encoding
            self.refuse_call(call, status, why)
            raise BodyRefused(status, why) from None
        call.encoding = content_encoding
        return plain

    def take_body(self, call: Call, plain: bytes) -> bool:
        """The request's body (decoded by `read_body` when it came encoded). True: an LLM call, now numbered in its
        episode and recorded from here on (its body rewritten when the route says so). False: a side call that
        shares the path; nothing is recorded, and the request goes on as it came, to its own host."""
        pending = call.pending
        if call.encoding is None:
            call.raw = plain
        try:
            request, exact = json.loads(plain), True
        except ValueError:
            request, exact = _read_leniently(plain), False
        except RecursionError:
            why = "request body nests JSON deeper than lcap's parser reads"
            pending.request_body = plain
            self.refuse_call(call, 400, why)
            raise BodyRefused(400, why) from None
        if not dialects.looks_like_call(pending.dialect, request):
            return False
        pending.request_body, call.body = plain, call.raw
        pending.model_requested = request.get("model")
        if pending.episode_id is None and self.sessions is not None:
            self._attribute_by_body(call, request)
        pending.role = self.roles.of(pending.role, request, pending.episode_id, pending.dialect)
        if call.route is not None and call.route.replica is not None:  # the episode's replica, the role's adapter
            self._repoint(call, self.router.route(pending.episode_id, role=pending.role) or call.route)
        if call.route is not None and exact:  # a body read leniently goes on as it came: the upstream judges it
            call.request = request
            call.body = self._forward(call)
            self._plain_fields(call)
        pending.started_at, pending.t0 = time.time(), time.perf_counter()  # the call starts once it is whole
        pending.seq = self.next_seq(pending.episode_id)
        return True

    def _attribute_by_body(self, call: Call, request: dict) -> None:
        """A call no credentials or header placed: its Responses chain or its conversation may (sessions.py)."""
        assert self.sessions is not None
        pending = call.pending
        tenant = tenant_of(call.agent_fields)
        episode = self.sessions.by_body(pending.dialect, request, tenant)
        if episode is None:
            return
        pending.episode_id, pending.tenant = episode, tenant

    @staticmethod
    def _plain_fields(call: Call) -> None:
        """A body lcap decoded and rewrote goes to the upstream plain: without the agent's Content-Encoding."""
        if call.encoding is not None and call.body is not call.raw:
            call.fields = tuple(field for field in call.fields if field[0].lower() != b"content-encoding")

    def policy_request(self, pending: PendingTurn, request: dict, forward: dict, *, stitch: bool = True) -> bytes:
        """The request for lcap's endpoints: `forward` (the agent's request, the deployment's model) with lcap's
        options and the head of the conversation it may extend."""
        body = json.dumps(forward, ensure_ascii=False, separators=(",", ":")).encode()
        pending.token_ids = True
        head = None
        if self.stitch and stitch:
            pending.thread = dialects.thread_key(pending.dialect, request)
            head = self.heads.pick(pending.episode_id, *pending.thread)
            if head is not None:
                pending.offered_turn, pending.offered_thread = head.turn_id, head.thread_seq
        blob = head.blob if head is not None else None
        return policy_wire.request_body(
            body, adapt=self.adapt, stitch=self.stitch, head=blob, temperature=self.temperature
        )

    def policy_parts(self, pending: PendingTurn, record: bytes | None, head: bytes | None) -> None:
        """lcap's parts of an answer from its endpoints, as they arrive: the record, then the head, which becomes
        its conversation's head here before the agent has the end of the answer (and can send its next call)."""
        if record is not None:
            pending.lcap_record = record
        if head is None:
            return
        pending.lcap_head = head
        if pending.thread is None or pending.seq is None or head == b"null":
            return
        try:
            stitched = json.loads(pending.lcap_record or b"{}").get("stitched") is True
        except (ValueError, AttributeError):
            stitched = False
        thread = pending.offered_thread if stitched and pending.offered_thread is not None else pending.seq
        self.heads.put(pending.episode_id, Head(head, *pending.thread, pending.turn_id, thread))

    def _forward(self, call: Call) -> bytes:
        """The body to send along the call's route: asking for the route's model, and for token ids on that path."""
        assert call.route is not None
        request, pending = call.request, call.pending
        forward = with_route_model(request, call.route)
        if forward.get("model") != request.get("model"):
            why = "--upstream serves the deployment under its own name"
            pending.adapted = [
                {"field": "model", "action": "mapped", "from": request.get("model"), "to": forward["model"], "why": why}
            ]
        if pending.policy:
            return self.policy_request(pending, request, forward)
        pending.added = None
        if self.token_ids:
            pending.added = dialects.ask_token_ids(pending.dialect, forward)
            pending.token_ids = pending.added is not None
        return json.dumps(forward, ensure_ascii=False).encode() if forward != request else call.raw

    def refuse_call(self, call: Call, status: int, error: str) -> None:
        """A call refused before it was whole (a body past the limit): an error turn, numbered in its episode."""
        pending = call.pending
        pending.status_code = status
        pending.started_at, pending.t0 = time.time(), time.perf_counter()
        pending.seq = self.next_seq(pending.episode_id)
        self.close_call(pending, error)

    def rerouted_fields(
        self, fields: HeaderFields, route: Route, drop: frozenset[bytes] = _CREDENTIALS
    ) -> HeaderFields:
        """The agent's fields for `route`: its credentials for the original host go, the Host field follows."""
        out = []
        for field in fields:
            name = field[0].lower()
            if name == b"host":
                out.append((field[0], route.host_header))
            elif name not in drop:
                out.append(field)
        if route.authorization:
            out.append((b"authorization", route.authorization))
        elif self.upstream_api_key:
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
        if status >= 500 and pending.replica is not None:
            self.router.failed(pending.replica, f"it answered HTTP {status}")
        pending.encoding = encoding
        pending.streamed = "text/event-stream" in content_type
        if not pending.streamed:
            return None
        pending.chunks = []
        if pending.policy and status < 400:
            return PolicyStream(pending, self.max_body_bytes, functools.partial(self.policy_parts, pending))
        if pending.added is not None and status < 400:
            return SseRewriter(pending, self.max_body_bytes)
        return StreamCopy(pending, self.max_body_bytes)

    async def read_answer(self, pending: PendingTurn, body: bytes) -> bytes:
        """A whole answer as it came, decoded when lcap must rewrite it (the policy route, `--token-ids`) and it came
        encoded: off the event loop, within `max_body_bytes`. `AnswerRefused` (its turn stored, the answer kept as
        it came) when it cannot be decoded. A body returned decoded goes to the agent plain, without the answer's
        Content-Encoding."""
        rewrites = (pending.policy or pending.added is not None) and (pending.status_code or 500) < 400
        if not (rewrites and encoding.encoded(pending.encoding)):
            return body
        try:
            plain = await asyncio.to_thread(encoding.decode_body, body, pending.encoding, self.max_body_bytes)
        except (encoding.BodyTooLarge, encoding.UndecodableBody) as exc:  # an unknown coding too
            why = f"the answer: {exc}; lcap must read it to pass it on"
            pending.response_body = body
            self.close_call(pending, why)
            raise AnswerRefused(why) from None
        pending.encoding = None
        return plain

    def answer_body(self, pending: PendingTurn, body: bytes) -> bytes | None:
        """The whole answer (decoded by `read_answer` when lcap must rewrite it): the turn is recorded before the
        agent has it. Returns the body the agent gets when lcap changed it (the vLLM path, without the fields lcap
        asked for), else None."""
        pending.response_body = body
        out = None
        readable = (pending.status_code or 500) < 400 and pending.encoding in (None, "identity")
        if readable and pending.policy:
            parts = policy_wire.split_whole(body)
            if parts is not None:
                out, record, head = parts
                pending.response_body = out
                self.policy_parts(pending, record, None)
                self.policy_parts(pending, None, head)
        elif readable and pending.added is not None:
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
        pending.deployment = self.router.settle(pending.replica, pending.deployment)
        if error is not None:
            pending.error = error
        if (
            self.sessions is not None
            and pending.dialect == dialects.RESPONSES
            and pending.tenant is not None
            and pending.episode_id is not None
            and (pending.status_code or 500) < 400
        ):
            answer = b"".join(pending.chunks[:16]) if pending.chunks else pending.response_body
            self.sessions.answered(pending.episode_id, pending.tenant, answer)
        try:
            self.writer.put(pending)
        finally:  # the call is over whatever became of its turn: `lcap status` must not count it in flight
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
