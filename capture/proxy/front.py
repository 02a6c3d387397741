"""The listener agents talk to: plain HTTP/1.1 LLM calls take a short path, everything else goes to mitmproxy.

mitmproxy's per-call machinery (protocol layers, event dispatch, hook plumbing) costs a few
milliseconds per call on a small machine, more than a proxy in front of an LLM may add. The front
serves the common case itself: an HTTP/1.1 POST to an LLM path with a Content-Length body, in the
clear or inside a CONNECT tunnel whose TLS it terminates with lcap's CA. What happens to the call
itself (attribution, rerouting, recording) is `Calls` (capture/proxy/calls.py), which the mitmproxy addon
drives too, so capture has one implementation.

Every request head is read here first, parsed by llhttp (capture/proxy/http1.py), checked against the
limits (`ProxyOptions`) and the episode credentials; what fails gets lcap's answer (400, 407, 408,
413, 431, 503) and nothing else. Any connection the front does not serve in full is then handed to
the embedded mitmproxy together with the bytes read so far, and spliced there for the rest of its
life: an HTTP/2-only or non-TLS tunnel, an upgrade (Responses over WebSocket), `Expect`, a chunked
request body, a request that is not an LLM call (telemetry, model lists). A compressed request body is
decoded (`Calls.read_body`, within `--max-body-bytes`, in a worker thread) and sent on as it came. Traffic
never depends on the short path.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
from mitmproxy.proxy.layers.tls import parse_client_hello
from mitmproxy.tls import ClientHello

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.calls import (
    UNASKED_SWITCH,
    AnswerRefused,
    BodyRefused,
    Call,
    Calls,
    Fields,
    HoldRefused,
    NoRoute,
    Unauthorized,
)
from lcap.capture.proxy.connections import (
    READ_SIZE,
    Admission,
    AgentReader,
    Expired,
    Plain,
    TlsServerSide,
    UpstreamPool,
    Watches,
    original_destination,
)
from lcap.capture.proxy.http1 import (
    HEAD_END,
    PROXY_AUTHENTICATE,
    BadRequest,
    RequestHead,
    not_a_head,
    parse_request_head,
    refusal,
)
from lcap.capture.reach.names import Names
from lcap.capture.trust.certs import LeafCerts
from lcap.capture.trust.destinations import Destinations, Forbidden
from lcap.capture.turns import dialects
from lcap.capture.turns.turn import agent_left

log = logging.getLogger("lcap.capture")

HEAD_HOLD = 0.001  # seconds a streamed answer's head may wait for its first piece of body (see `_stream`)
LINGER = 1.0  # seconds a refused connection is read (and discarded) before it closes, so the agent reads the answer
MAX_LINGERING = 64
# A redirected connection (`--transparent`) whose agent says nothing for this long is a protocol where the server
# speaks first (SSH, SMTP, MySQL, ...): it is passed through. On these ports it is at once (and DNS over TCP); on
# HTTP's ports, and to an address only lcap's DNS gave out, the agent speaks first however slowly it starts (a JVM
# under load may take seconds to its TLS hello).
FIRST_BYTES_WAIT = 3.0
PASS_THROUGH_PORTS = frozenset((21, 22, 25, 53, 110, 143, 587, 3306, 5900))
CLIENT_FIRST_PORTS = frozenset((80, 443, 8000, 8080, 8443))


# --- requests -------------------------------------------------------------------------------------


@dataclass
class Tunnel:
    """A CONNECT the front accepted: where the agent meant to go, and how to replay it to mitmproxy."""

    host: str
    port: int
    connect_head: bytes
    episode: str | None
    tls: bool = True
    sni: str | None = None
    redirected: bool = False  # reached lcap by a namespace's redirect, not by a CONNECT (`--transparent`)


class Unserved(Exception):
    """The short path does not serve this request: mitmproxy gets the connection."""


class Refused(Exception):
    """The front answers the agent itself with `status` and closes the connection."""

    def __init__(self, status: int, message: str, fields: bytes = b"") -> None:
        super().__init__(message)
        self.status, self.message, self.fields = status, message, fields


class _UpstreamTimeout(Exception):
    """An upstream took longer than a `ProxyOptions` timeout allows: 504."""


class _AnswerRefused(Exception):
    """An upstream's answer past a `ProxyOptions` limit lcap will not relay (its head too big): 502."""


class _Unreached(Exception):
    """The call never reached an upstream that answered it: no connection, or one closed before any answer."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _AgentGone(Exception):
    """The agent closed its connection, or stopped reading, while its call ran."""


class _Exchange:
    """One call's upstream connection, and whether the agent left while it ran: then the upstream connection is
    aborted at once, which wakes whatever waits on it."""

    __slots__ = ("gone", "upstream")

    def __init__(self) -> None:
        self.upstream: Plain | None = None
        self.gone = False

    def agent_left(self) -> None:
        self.gone = True
        if self.upstream is not None:
            self.upstream.abort()


_HOP_FIELDS = frozenset((b"connection", b"keep-alive", b"te", b"trailer", b"proxy-connection"))


class _ResponseParts:
    """httptools callbacks: the head and the body pieces of one upstream response."""

    def __init__(self) -> None:
        self.reason = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.keep_alive = False
        self.complete = False
        self.trailing = False  # bytes came after the answer: the connection is not reused
        self.body: list[bytes] = []
        self.size = 0
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.trailing = self.complete  # what follows the answer is nobody's: dropped, and the connection with it

    def on_status(self, reason: bytes) -> None:
        if not self.trailing:
            self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.trailing:
            self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        if self.trailing or self._interim():
            return
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message is complete

    def on_body(self, data: bytes) -> None:
        if not self.trailing:
            self.body.append(data)
            self.size += len(data)

    def on_message_complete(self) -> None:
        if self.trailing:
            return
        if self._interim():  # 100 Continue, 103 Early Hints: the answer is still to come
            self.reason, self.fields = b"", []
            return
        self.complete = True

    def feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # the front relays no upgrade: those calls go to mitmproxy
            raise httptools.HttpParserError(UNASKED_SWITCH) from None
        except httptools.HttpParserError:
            if not self.complete:
                raise
            self.trailing = True  # garbage after a whole answer: the answer stands, the connection goes

    def _interim(self) -> bool:
        return 100 <= self.parser.get_status_code() < 200 and not self.complete


# --- the server -----------------------------------------------------------------------------------


class Front:
    """Accepts the agents' connections; serves LLM calls, hands the rest to mitmproxy on `mitm_port`."""

    def __init__(
        self,
        calls: Calls,
        mitm_port: int,
        certs: LeafCerts,
        options: ProxyOptions,
        destinations: Destinations,
        handoff_ports: dict[int, str | None],
        names: Names,
    ) -> None:
        self.calls = calls
        self.mitm_port = mitm_port
        self.certs = certs
        self.options = options
        self.destinations = destinations
        self.admission = Admission(
            options.max_connections, options.max_client_connections, options.max_episode_connections
        )
        self.pool = UpstreamPool()
        self.server: asyncio.Server | None = None
        # local ports of the front's own connections to mitmproxy, the only ones it serves (`FrontOnly`), and the
        # episode each connection is known to belong to (its listener's, or its tunnel's) if any
        self.handoff_ports = handoff_ports
        self.names = names  # the names lcap's DNS answered, for redirected connections
        self.watches = Watches()  # the deadlines of every agent connection's waits
        self._lingering = 0

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(_agent_protocol(loop, self._connection), host, port, backlog=512)
        self.watches.start(loop)
        return self.server.sockets[0].getsockname()[1]

    async def listen_episode(
        self,
        episode: str,
        sock: socket.socket | None = None,
        *,
        redirected: bool = False,
        admit: Callable[[tuple[str, int], tuple[str, int]], bool] | None = None,
    ) -> asyncio.Server:
        """A listener whose every connection is `episode`'s, no credentials needed: a new loopback port for clients
        that cannot present them (the JVM), which serves only the connections `admit(listener, peer)` accepts (the
        agent's own processes: the port is reachable by any); or `sock`, the listener of an agent's namespace
        (`redirected`: every connection made there was redirected to it, and says where it was going by
        SO_ORIGINAL_DST)."""
        loop = asyncio.get_running_loop()
        handle = functools.partial(self._connection, episode=episode, redirected=redirected, admit=admit)
        protocol = _agent_protocol(loop, handle)
        if sock is None:
            return await loop.create_server(protocol, "127.0.0.1", 0, backlog=512)
        return await loop.create_server(protocol, sock=sock, backlog=512)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.watches.stop()
        self.pool.close()

    async def _connection(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        episode: str | None = None,
        redirected: bool = False,
        admit: Callable[[tuple[str, int], tuple[str, int]], bool] | None = None,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = self.watches.add(task)
        client = Plain(reader, writer, watch)
        client.episode = episode
        peer = writer.get_extra_info("peername")
        # an episode's own listener is its own client (a namespace's connections all come from its 127.0.0.1)
        group = ("episode", episode) if episode is not None else ("address", peer[0] if isinstance(peer, tuple) else "")
        try:
            seat = self.admission.enter(group, client.abort)
            if seat is None:
                try:
                    await self._refuse(client, Refused(503, "too many connections open: try again later"))
                finally:
                    client.close()
                return
            client.seat = seat
            try:
                if admit is not None and not await _admitted(admit, writer):
                    return await self._refuse(client, Refused(403, f"this port serves episode {episode}'s agent only"))
                if redirected:
                    await self._redirected(client)
                else:
                    await self._serve(client, None, b"")
            except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, asyncio.CancelledError):
                pass
            except Exception:
                log.exception("lcap: front connection failed")
            finally:
                self.admission.leave(seat)
                client.close()
        finally:
            self.watches.active.discard(watch)

    async def _refuse(self, client: Plain, refused: Refused) -> None:
        """Answer with lcap's own refusal and end the connection. The agent may still be writing (a body past the
        limit): its side is read and dropped for up to `LINGER` seconds, so its kernel does not reset the
        connection before it has read the answer."""
        client.send(refusal(refused.status, refused.message, refused.fields))
        if self._lingering >= MAX_LINGERING:
            return
        self._lingering += 1
        try:
            client.send_eof()
            with client.deadline(LINGER, "linger"):
                while await client.recv():
                    pass
        except (Expired, OSError, ssl.SSLError):
            pass
        finally:
            self._lingering -= 1

    async def _serve(self, client: Plain, tunnel: Tunnel | None, buf: bytes) -> None:
        """Serve one call after another on the agent's connection, until it closes or leaves for mitmproxy."""
        try:
            while True:
                got = await self._next_head(client, buf)
                if got is None:
                    return
                raw_head, buf = got
                try:
                    head = parse_request_head(raw_head)
                except BadRequest as exc:
                    raise Refused(400, f"bad request head: {exc}") from None
                try:
                    episode, fields = self.calls.attribute(head.fields, tunnel.episode if tunnel else client.episode)
                except Unauthorized:
                    raise Refused(
                        407,
                        "this proxy needs episode credentials: use the proxy URL lcap gave "
                        "(http://EPISODE:SECRET@host:port, see `lcap episode new`)",
                        PROXY_AUTHENTICATE,
                    ) from None
                if (
                    episode is not None
                    and client.seat is not None
                    and not self.admission.attribute(client.seat, episode)
                ):
                    raise Refused(
                        503,
                        f"episode {episode} has {self.admission.per_episode} connections open, none idle "
                        "(--max-episode-connections): try again later",
                    )
                if head.method == b"CONNECT":
                    if tunnel is not None:
                        return await self._hand_off(client, raw_head + buf, tunnel)
                    return await self._tunnel(client, head, episode, raw_head, buf)
                try:
                    if why := head.unserved():
                        raise Unserved(why)
                    target = _target(head, tunnel)
                except Unserved:
                    return await self._hand_off(client, raw_head + buf, tunnel)
                rest = await self._take_call(client, tunnel, head, target, episode, fields, raw_head, buf)
                if rest is None:
                    return
                buf = rest
        except Refused as refused:
            await self._refuse(client, refused)

    async def _take_call(
        self,
        client: Plain,
        tunnel: Tunnel | None,
        head: RequestHead,
        target: tuple[str, str, str, int, str],
        episode: str | None,
        fields: Fields,
        raw_head: bytes,
        buf: bytes,
    ) -> bytes | None:
        """Read the call's body and forward it; the bytes after it (a pipelined request), or None when the
        agent's connection is done."""
        dialect, scheme, host, port, path = target
        try:  # before the body: clients often write it separately, and this work is then done while it comes
            call = self.calls.open_call(dialect, episode, scheme=scheme, host=host, port=port, path=path, fields=fields)
            upstream_head, client_close = _request_head(call)
        except NoRoute as exc:
            raise Refused(503, str(exc)) from None
        except Exception:  # a capture bug: mitmproxy takes the call (and refuses it rather than leak it when rerouted)
            log.exception("lcap: capture error on %s (the call goes through mitmproxy)", path)
            await self._hand_off(client, raw_head + buf, tunnel)
            return None
        length = head.length
        assert length is not None  # `unserved` said so
        if length > self.options.max_body_bytes:
            why = f"request body of {length} bytes over the limit of {self.options.max_body_bytes} bytes (--max-body-bytes)"
            self.calls.refuse_call(call, 413, why)
            raise Refused(413, why)
        if len(buf) < length:
            got = await self._body(client, buf, length)
            if got is None:
                return None
            buf = got
        body, buf = buf[:length], buf[length:]
        coding = b", ".join(value for name, value in fields if name.lower() == b"content-encoding")
        try:
            plain = await self.calls.read_body(call, body, coding.decode("latin-1"))
            is_call = self.calls.take_body(call, plain)
            if is_call and call.body is not call.raw:  # rewritten: the head follows the body's fields
                upstream_head, client_close = _request_head(call)
        except BodyRefused as refused:  # its turn is stored already
            raise Refused(refused.status, str(refused)) from None
        except Exception:
            log.exception("lcap: capture error on %s (the call goes through mitmproxy)", path)
            is_call = False
        if not is_call:  # a side call on an LLM path (or a capture bug): mitmproxy sends it on, to the route if any
            await self._hand_off(client, raw_head + body + buf, tunnel)
            return None
        if not await self._call(client, call, upstream_head, client_close):
            return None
        return buf

    async def _next_head(self, client: Plain, buf: bytes) -> tuple[bytes, bytes] | None:
        """(the next request head, the bytes after it); None when the agent closed its connection or left it idle
        for `idle_timeout` (`head_timeout` for a new connection that proved no episode). A head over `max_head_bytes` is
        a 431, one that takes over `head_timeout` a 408. While it waits for the head's first byte, the connection is
        idle: `Admission` may close it to make room."""
        options = self.options
        if not buf:
            seat = client.seat
            # a connection that proved no episode, and never sent a request, waits no longer than for a head
            fresh = seat is not None and not seat.attributed and not client.served
            try:
                with client.deadline(options.head_timeout if fresh else options.idle_timeout, "idle"):
                    if seat is not None:
                        self.admission.waiting(seat)
                    try:
                        buf = await client.recv()
                    finally:
                        if seat is not None:
                            self.admission.busy(seat)
            except Expired:
                return None
            if not buf:
                return None
        client.served = True
        end = HEAD_END.search(buf)
        if end is None and not_a_head(buf):
            raise Refused(400, "not an HTTP/1 request (TLS to a plain proxy URL? the proxy URL is http://)")
        if end is None:
            pieces = bytearray(buf)
            try:
                with client.deadline(options.head_timeout, "head"):
                    while end is None:
                        if len(pieces) > options.max_head_bytes:
                            break
                        data = await client.recv()
                        if not data:
                            return None
                        start = max(0, len(pieces) - 2)
                        pieces += data
                        end = HEAD_END.search(pieces, start)
            except Expired:
                raise Refused(408, f"the request head took over {options.head_timeout:g} s (--head-timeout)") from None
            buf = bytes(pieces)
        if end is None or end.end() > options.max_head_bytes:
            raise Refused(431, f"request head over {options.max_head_bytes} bytes (--max-head-bytes)")
        return buf[: end.end()], buf[end.end() :]

    async def _body(self, client: Plain, buf: bytes, length: int) -> bytes | None:
        """The body (and what follows it) once `length` bytes came; None when the agent left first."""
        pieces, have = [buf], len(buf)
        try:
            with client.deadline(self.options.body_timeout, "body"):
                while have < length:
                    data = await client.recv()
                    if not data:
                        return None
                    pieces.append(data)
                    have += len(data)
        except Expired:
            raise Refused(408, f"the request body took over {self.options.body_timeout:g} s (--body-timeout)") from None
        return b"".join(pieces)

    async def _call(self, client: Plain, call: Call, upstream_head: bytes, client_close: bool) -> bool:
        """Forward one call and answer the agent; False when the agent's connection is done."""
        exchange = _Exchange()
        reader = client.reader
        assert isinstance(reader, AgentReader)
        reader.notify(exchange.agent_left)  # at once if the agent already closed (or half-closed) its side
        try:
            upstream, parts = await self._send(client, call, upstream_head, exchange)
            reuse = await self._answer(client, call, upstream, parts, client_close, exchange)
        except HoldRefused as refused:  # its turn is stored and counted already
            client.send(refusal(503, str(refused), close=False))
            return True
        except AnswerRefused as refused:  # its turn is stored already
            if exchange.upstream is not None:
                exchange.upstream.close()
            client.send(refusal(502, str(refused), close=False))
            return True
        except BaseException as exc:
            if exchange.upstream is not None:
                exchange.upstream.close()
            if exchange.gone or isinstance(exc, _AgentGone):
                started = call.pending.status_code is not None
                self.calls.close_call(
                    call.pending, str(exc) if isinstance(exc, _AgentGone) and str(exc) else agent_left(started)
                )
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return False
            if not isinstance(
                exc, (OSError, EOFError, httptools.HttpParserError, _UpstreamTimeout, _AnswerRefused, Forbidden)
            ):
                self.calls.close_call(call.pending, "the call was interrupted")
                raise
            if isinstance(exc, Forbidden):
                status, why = 403, str(exc)
            else:
                self.calls.router.failed(call.pending.replica, f"{exc.__class__.__name__}: {exc}")
                status = 504 if isinstance(exc, _UpstreamTimeout) else 502
                why = f"upstream {call.scheme}://{call.host}:{call.port}: {exc.__class__.__name__}: {exc}"
                if isinstance(exc, (_UpstreamTimeout, _AnswerRefused)):
                    why = f"upstream {call.scheme}://{call.host}:{call.port}: {exc}"
            self.calls.close_call(call.pending, why)
            if call.pending.chunks is not None:  # a stream: the agent may have part of it, cut it off
                return False
            client.send(refusal(status, why, close=False))
            return True
        finally:
            reader.notify(None)
        if reuse:
            self.pool.give_back((call.scheme, call.host, call.port), upstream)
        else:
            upstream.close()
        return reuse is not None and not client_close

    async def _send(
        self, client: Plain, call: Call, upstream_head: bytes, exchange: _Exchange
    ) -> tuple[Plain, _ResponseParts]:
        """Send the call upstream and read its response head. While every policy replica restarts, the call
        waits for one to serve again (`Calls.hold`). A call that cannot reach a policy replica (no connection, or
        the connection closed before any answer: the replica never answered it) goes to the episode's next
        replica, the failed one leaving the rotation; at most once per replica. With no replica left to try it
        waits too if the record now says they all restart (it was sent before this proxy read that)."""
        while True:
            if self.calls.must_hold(call):
                if not await self.calls.hold(call, lambda: exchange.gone):
                    raise _AgentGone
                upstream_head, _ = _request_head(call)
            try:
                return await self._attempt(client, call, upstream_head, exchange)
            except _Unreached as unreached:
                if exchange.gone:
                    raise _AgentGone from None
                if self.calls.failover(call, str(unreached.error)):
                    upstream_head, _ = _request_head(call)
                elif not self.calls.must_hold(call):
                    raise unreached.error from None

    async def _attempt(
        self, client: Plain, call: Call, upstream_head: bytes, exchange: _Exchange
    ) -> tuple[Plain, _ResponseParts]:
        """One upstream: a reused connection the upstream closed without a byte of answer is replaced once, as HTTP
        clients do with idle connections (the upstream closed it idle). `_Unreached` when the upstream never saw
        or never answered the call."""
        message = b"%s%d\r\n\r\n%s" % (upstream_head, len(call.body), call.body)
        key = (call.scheme, call.host, call.port)
        upstream = self.pool.take(key)
        may_retry = upstream is not None
        while True:
            if upstream is None:
                try:
                    upstream = await self._open(client, call, key)
                except (OSError, _UpstreamTimeout) as exc:
                    raise _Unreached(exc) from None
            exchange.upstream = upstream
            if exchange.gone:
                raise _AgentGone
            try:
                return upstream, await _response_head(upstream, message, client, self.options)
            except _Stale:
                upstream.close()
                if exchange.gone:
                    raise _AgentGone from None
                if not may_retry:
                    raise _Unreached(EOFError("the upstream closed the connection before answering")) from None
                upstream, may_retry = None, False

    async def _open(self, client: Plain, call: Call, key: tuple[str, str, int]) -> Plain:
        """A new upstream connection; the configured upstream is trusted, any other destination is checked."""
        timeout = self.options.connect_timeout
        try:
            with client.deadline(timeout, "connect"):
                address = key[1] if call.route is not None else await self.destinations.address(key[1], key[2])
                return await self.pool.open(key, address)
        except Expired:
            raise _UpstreamTimeout(f"no connection within {timeout:g} s (--connect-timeout)") from None

    async def _answer(
        self, client: Plain, call: Call, upstream: Plain, parts: _ResponseParts, client_close: bool, exchange: _Exchange
    ) -> bool | None:
        """Relay the response to the agent, recording it. True: the upstream connection can serve another
        call; False: it cannot; None: neither can the agent's."""
        parser = parts.parser
        status = parser.get_status_code()
        content_type = encoding = transfer = b""
        length = None
        keep = []
        for field in parts.fields:
            name = field[0].lower()
            if name == b"content-length":
                length = field[1]
            elif name == b"transfer-encoding":
                transfer = field[1].lower()
            elif name not in _HOP_FIELDS:
                if name == b"content-type":
                    content_type = field[1]
                elif name == b"content-encoding":
                    encoding = field[1]
                keep.append(field)
        no_body = status in (204, 304)
        framed = no_body or length is not None or b"chunked" in transfer
        if client_close or not framed:
            keep.append((b"connection", b"close"))
        head = _answer_head(status, parts.reason, keep)
        transform = self.calls.answer_head(
            call.pending, status, content_type.decode("latin-1"), encoding.decode("latin-1") or None
        )
        if transform is not None:
            # framed answers go out chunked (the transform may change lengths); others end with the connection
            head += b"transfer-encoding: chunked\r\n\r\n" if framed else b"\r\n"
            await self._stream(client, upstream, parts, head, transform, framed, exchange)
            if framed and not parts.complete:
                raise EOFError("the upstream closed the connection mid-stream")
            self.calls.close_call(call.pending)
        else:
            idle, limit = self.options.stream_idle_timeout, self.options.max_body_bytes
            while parts.size <= limit and not parts.complete:
                data = await _recv(upstream, client, idle)
                if not data:
                    if exchange.gone:
                        raise _AgentGone
                    if framed:
                        raise EOFError("the upstream closed the connection mid-response")
                    break
                parts.feed(data)
            if parts.size > limit:
                raise EOFError(f"the answer is over {limit} bytes (--max-body-bytes)")
            raw = b"".join(parts.body)
            plain = await self.calls.read_answer(call.pending, raw)
            body = self.calls.answer_body(call.pending, plain) or plain
            if body is not raw and encoding:  # lcap decoded or rewrote it: the agent gets it plain
                head = _answer_head(status, parts.reason, [f for f in keep if f[0].lower() != b"content-encoding"])
            client.send(head + (b"\r\n" if no_body else b"content-length: %d\r\n\r\n" % len(body)) + body)
        try:
            with client.deadline(self.options.stream_idle_timeout, "drain"):
                await client.drain()
        except (ConnectionError, Expired):  # gone, or not reading: its connection is done (the turn is recorded)
            return None
        return parts.keep_alive and not parts.trailing if framed else None

    async def _stream(
        self,
        client: Plain,
        upstream: Plain,
        parts: _ResponseParts,
        head: bytes,
        transform: Callable[[bytes], bytes | list[bytes]],
        chunked: bool,
        exchange: _Exchange,
    ) -> None:
        """Pass the body on as it comes, never buffered: one write per upstream read. The head waits up to
        `HEAD_HOLD` seconds for the first piece of body to send (an event whole, on the vLLM path) and goes out
        with it: upstreams often write the two back to back, and one write is one TLS record for the agent
        to open instead of two. `_AgentGone` when the agent went away or stopped reading for as long as
        an upstream may pause."""
        idle = self.options.stream_idle_timeout
        out = [head]
        hold = None
        if not parts.body and not parts.complete:
            hold = asyncio.get_running_loop().call_later(HEAD_HOLD, _send_now, client, out)
        try:
            while True:
                pieces, parts.body = parts.body, []
                for piece in pieces:
                    _frame(out, transform(piece), chunked)
                if parts.complete:
                    break
                if hold is not None and not (len(out) == 1 and out[0] is head):  # body to send, or the timer fired
                    hold.cancel()
                    hold = None
                if out and hold is None:
                    _send_now(client, out)
                    try:
                        with client.deadline(idle, "drain"):
                            await client.drain()
                    except (ConnectionError, Expired):
                        raise _AgentGone(f"the agent stopped reading the answer for {idle:g} s") from None
                    if client.writer.is_closing():
                        raise _AgentGone
                data = await _recv(upstream, client, idle)
                if not data:
                    if exchange.gone:
                        raise _AgentGone
                    break
                parts.feed(data)
        finally:
            if hold is not None:
                hold.cancel()
        _frame(out, transform(b""), chunked)
        if chunked and parts.complete:
            out.append(b"0\r\n\r\n")
        client.send(b"".join(out))

    # --- tunnels and hand-off ---------------------------------------------------------------------

    async def _tunnel(self, client: Plain, head: RequestHead, episode: str | None, raw_head: bytes, buf: bytes) -> None:
        """Accept a CONNECT; terminate TLS when the agent offers HTTP/1.1, else hand the tunnel on unopened."""
        host, _, port = head.target.decode("ascii", "replace").rpartition(":")
        if not host or not port.isdigit():
            return await self._hand_off(client, raw_head + buf, None)
        tunnel = Tunnel(host.strip("[]"), int(port), raw_head, episode)
        try:
            await self.destinations.check_tunnel(tunnel.host, tunnel.port)
        except Forbidden as exc:
            raise Refused(403, str(exc)) from None
        client.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
        return await self._open_tunnel(client, tunnel, buf)

    async def _open_tunnel(self, client: Plain, tunnel: Tunnel, buf: bytes) -> None:
        """What the agent sends in an open tunnel: TLS is terminated and plain HTTP served (LLM calls take the short
        path), anything else is handed to mitmproxy unopened."""
        try:
            with client.deadline(self.options.head_timeout, "tunnel"):
                data, hello = await self._client_hello(client, buf)
                tls = await self._terminate(client, tunnel, data, hello) if hello is not None else None
        except (Expired, EOFError):  # a tunnel that does not say what it carries in time, or the agent left
            return
        if tls is not None:
            return await self._serve(tls, tunnel, b"")
        tunnel.tls = False
        if hello is None and data[:1].isalpha():  # plain HTTP inside the tunnel
            return await self._serve(client, tunnel, data)
        return await self._hand_off(client, data, tunnel)  # spliced unopened: mitmproxy takes it from there

    async def _redirected(self, client: Plain) -> None:
        """A connection an agent's namespace redirected here (`--transparent`): served as if the agent had asked for
        a tunnel to where it was going. A destination on the host's loopback (a local model server, a database)
        is passed through as it is, unstored; so is a protocol where the server speaks first."""
        sock = client.writer.get_extra_info("socket")
        destination = original_destination(sock) if sock is not None else None
        if destination is None:
            return
        address, port = destination
        if ipaddress.ip_address(address).is_loopback or port in PASS_THROUGH_PORTS:
            return await self._pass_through(client, address, port)
        speaks_first = port in CLIENT_FIRST_PORTS or self.names.is_stand_in(address)
        try:
            with client.deadline(self.options.head_timeout if speaks_first else FIRST_BYTES_WAIT, "first bytes"):
                data = await client.recv()
        except Expired:
            if speaks_first:
                return
            return await self._pass_through(client, address, port)
        if data:
            host = self.names.name_of(address) or address
            tunnel = Tunnel(host, port, _connect_head(host, port), client.episode, redirected=True)
            await self._open_tunnel(client, tunnel, data)

    async def _pass_through(self, client: Plain, host: str, port: int) -> None:
        """Relay the agent's connection to `host:port` byte for byte, nothing looked at or stored."""
        try:
            with client.deadline(self.options.connect_timeout, "connect"):
                reader, writer = await asyncio.open_connection(host, port, limit=READ_SIZE)
        except (Expired, OSError):
            return
        server = Plain(reader, writer)
        try:
            await _splice(client, server)
        finally:
            server.close()

    async def _client_hello(self, client: Plain, data: bytes) -> tuple[bytes, ClientHello | None]:
        """What the agent first sends in a tunnel, and its TLS ClientHello if it is TLS. EOFError: it left."""
        while True:
            try:
                hello = parse_client_hello(data) if data else None
            except ValueError:  # not TLS
                return data, None
            if hello is not None or len(data) > self.options.max_head_bytes:
                return data, hello
            chunk = await client.recv()
            if not chunk:
                raise EOFError
            data += chunk

    async def _terminate(self, client: Plain, tunnel: Tunnel, data: bytes, hello: ClientHello) -> TlsServerSide | None:
        """TLS with lcap's certificate for the agent's server name, when the agent offers HTTP/1.1; None
        otherwise (an HTTP/2-only offer: mitmproxy negotiates HTTP/2 itself)."""
        if hello.alpn_protocols and b"http/1.1" not in hello.alpn_protocols:
            return None
        if tunnel.redirected and hello.sni and _is_address(tunnel.host):
            tunnel.host = hello.sni  # the name the agent connected to, for the turn and for mitmproxy's CONNECT
            tunnel.connect_head = _connect_head(hello.sni, tunnel.port)
        tunnel.sni = hello.sni or tunnel.host
        try:
            context = self.certs.context(tunnel.sni)
        except Exception as exc:  # a name lcap cannot make a certificate for: mitmproxy decides what to do
            log.warning("lcap: no certificate for %r (%s); the tunnel goes to mitmproxy", tunnel.sni, exc)
            return None
        tls = TlsServerSide(client.reader, client.writer, context, client.watch, client.seat)
        await tls.handshake(data)
        return tls

    async def _hand_off(self, client: Plain, data: bytes, tunnel: Tunnel | None) -> None:
        """Give the connection to mitmproxy: replay the CONNECT (and TLS) it came through, then what was read.
        mitmproxy accepts only connections from the ports the front registers here (`FrontOnly`)."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        port = None
        mitm = None
        try:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            self.handoff_ports[port] = tunnel.episode if tunnel is not None else client.episode
            await loop.sock_connect(sock, ("127.0.0.1", self.mitm_port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=READ_SIZE)
            mitm = Plain(reader, writer)
            if tunnel is not None:
                writer.write(tunnel.connect_head)
                try:
                    with client.deadline(self.options.head_timeout, "hand-off"):
                        answer = await reader.readuntil(b"\r\n\r\n")
                except Expired:
                    raise ConnectionError("mitmproxy did not answer the replayed CONNECT") from None
                if b" 200 " not in answer.split(b"\r\n", 1)[0] + b" ":
                    raise ConnectionError(f"mitmproxy refused the tunnel: {answer[:80]!r}")
                if tunnel.tls:
                    await writer.start_tls(self._peer_tls, server_hostname=tunnel.sni)
            if data:
                mitm.send(data)
            await _splice(client, mitm)
        finally:
            if port is not None:
                self.handoff_ports.pop(port, None)
            if mitm is not None:
                mitm.close()
            else:
                sock.close()

    @functools.cached_property
    def _peer_tls(self) -> ssl.SSLContext:
        """TLS from the front to mitmproxy over loopback: mitmproxy's certificate is lcap's own."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


def _agent_protocol(
    loop: asyncio.AbstractEventLoop, handle: Callable[..., Awaitable[None]]
) -> Callable[[], asyncio.StreamReaderProtocol]:
    """The protocol factory of a listener for agents: each connection's reader is an `AgentReader`."""
    return lambda: asyncio.StreamReaderProtocol(AgentReader(limit=READ_SIZE, loop=loop), handle, loop=loop)


async def _admitted(admit: Callable[[tuple[str, int], tuple[str, int]], bool], writer: asyncio.StreamWriter) -> bool:
    """`admit(listener, peer)`, off the event loop (it reads /proc)."""
    own, peer = writer.get_extra_info("sockname"), writer.get_extra_info("peername")
    if not isinstance(own, tuple) or not isinstance(peer, tuple):
        return False
    return await asyncio.get_running_loop().run_in_executor(None, admit, own[:2], peer[:2])


def _connect_head(host: str, port: int) -> bytes:
    """The CONNECT a redirected connection is handed to mitmproxy with (the front told it the episode)."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode("ascii", "replace")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _request_head(call: Call) -> tuple[bytes, bool]:
    """The call's head for the upstream, up to the value of its Content-Length, and whether the agent asked to
    close its connection after it. Connection-level fields concern the agent's hop, not the upstream's."""
    client_close = False
    forwarded = []
    for field in call.fields:
        name = field[0].lower()
        if name in _HOP_FIELDS:
            client_close = client_close or (name == b"connection" and b"close" in field[1].lower())
        else:
            forwarded.append(field)
    fields = b"".join(b"%s: %s\r\n" % f for f in forwarded)
    path = call.path.encode("utf-8", "surrogateescape")
    return b"POST %s HTTP/1.1\r\n%scontent-length: " % (path, fields), client_close


def _answer_head(status: int, reason: bytes, fields: list[tuple[bytes, bytes]]) -> bytes:
    """An answer's head for the agent, up to its framing fields."""
    return b"HTTP/1.1 %d %s\r\n%s" % (status, reason, b"".join(b"%s: %s\r\n" % f for f in fields))


def _target(head: RequestHead, tunnel: Tunnel | None) -> tuple[str, str, str, int, str]:
    """(dialect, scheme, host, port, path) of a POST on an LLM path; `Unserved` for any other."""
    target = head.target.decode("utf-8", "surrogateescape")
    if tunnel is not None:
        if not target.startswith("/"):
            raise Unserved("target")
        scheme, host, port, path = ("https" if tunnel.tls else "http"), tunnel.host, tunnel.port, target
    else:
        if not target.startswith("http://"):
            raise Unserved("target")
        url = urlsplit(target)
        try:
            port = url.port or 80
        except ValueError:
            raise Unserved("target") from None
        if not url.hostname:
            raise Unserved("target")
        scheme, host, path = "http", url.hostname, target[len("http://") + len(url.netloc) :] or "/"
    dialect = dialects.match("POST", path)
    if dialect is None:
        raise Unserved("not an LLM path")
    return dialect, scheme, host, port, path


class _Stale(Exception):
    """The upstream closed a kept-alive connection before any of the response came back."""


async def _recv(upstream: Plain, client: Plain, timeout: float) -> bytes:
    """The upstream's next bytes; `_UpstreamTimeout` when it is silent for `timeout` seconds."""
    try:
        with client.deadline(timeout, "upstream"):
            return await upstream.recv()
    except Expired:
        raise _UpstreamTimeout(
            f"silent for {timeout:g} s in the middle of its answer (--stream-idle-timeout)"
        ) from None


async def _response_head(upstream: Plain, message: bytes, client: Plain, options: ProxyOptions) -> _ResponseParts:
    """Send the call and read its answer's head: its first byte within `first_byte_timeout`, the rest within
    `head_timeout` of it, and all of it (interim heads included) within `max_head_bytes`."""
    upstream.send(message)
    parts = _ResponseParts()
    got = 0
    head_timeout, limit = options.head_timeout, options.max_head_bytes
    try:
        with client.deadline(options.first_byte_timeout, "first byte") as watch:
            while not parts.head_done:
                try:
                    data = await upstream.recv()
                except ConnectionResetError:
                    data = b""
                if not data:
                    if got:
                        raise EOFError("the upstream closed the connection mid-head")
                    raise _Stale
                if not got and watch.at is not None:
                    watch.at, watch.what = min(watch.at, time.monotonic() + head_timeout), "answer head"
                got += len(data)
                parts.feed(data)
                if not parts.head_done and got > limit:
                    raise _AnswerRefused(f"its answer head is over {limit} bytes (--max-head-bytes)")
    except Expired as expired:
        if str(expired) == "answer head":
            raise _UpstreamTimeout(f"its answer head took over {head_timeout:g} s (--head-timeout)") from None
        raise _UpstreamTimeout(f"no answer within {options.first_byte_timeout:g} s (--first-byte-timeout)") from None
    return parts


def _send_now(client: Plain, out: list[bytes]) -> None:
    if not client.writer.is_closing():  # the hold's timer may fire after the agent left
        client.send(b"".join(out))
    out.clear()


def _frame(out: list[bytes], data: bytes | list[bytes], chunked: bool) -> None:
    for piece in [data] if isinstance(data, bytes) else data:
        if piece:
            out.append(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)


async def _pipe(src: Plain, dst: Plain) -> None:
    try:
        while data := await src.recv():
            dst.send(data)
            await dst.drain()
        dst.send_eof()
    except (ConnectionError, ssl.SSLError, OSError):
        dst.close()


async def _splice(a: Plain, b: Plain) -> None:
    """Relay both ways until both directions ended."""
    await asyncio.gather(_pipe(a, b), _pipe(b, a))
