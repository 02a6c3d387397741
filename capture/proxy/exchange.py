"""The front's last layer: one HTTP/1.1 call sent to its upstream and its answer relayed back to the agent.

`Exchange.forward` sends a call `Calls` opened and read (capture/proxy/calls.py) on a connection of the upstream
pool, holds it while every policy replica restarts (`Calls.hold`), moves it to the episode's next replica when its
own never answered (`Calls.failover`), and relays the answer: a stream chunk by chunk through the transform
`Calls.answer_head` gives, never buffered; a whole answer once `Calls.answer_body` has recorded it. Every wait has
its `ProxyOptions` deadline; an upstream that fails is a 502 (a 504 past a deadline) with an error turn, and an
agent that leaves ends the call at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httptools

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.calls import Call, Calls
from lcap.capture.proxy.connections import AgentReader, Connection, Expired, UpstreamPool
from lcap.capture.proxy.http1 import refusal
from lcap.capture.proxy.refusals import UNASKED_SWITCH, AnswerRefused, HoldRefused
from lcap.capture.trust.destinations import Destinations, Forbidden
from lcap.capture.turns.turn import agent_left

HEAD_HOLD = 0.001  # seconds a streamed answer's head may wait for its first piece of body (see `_stream`)


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


class _InFlight:
    """One call's upstream connection, and whether the agent left while it ran: then the upstream connection is
    aborted at once, which wakes whatever waits on it."""

    __slots__ = ("gone", "upstream")

    def __init__(self) -> None:
        self.upstream: Connection | None = None
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


def request_head(call: Call) -> tuple[bytes, bool]:
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


def _own_answer(client: Connection, status: int, why: str, client_close: bool) -> bool:
    """Answer the call with lcap's own `status`; whether the connection serves another call: not when the call asked
    to close it (RFC 9112 9.6), as after a relayed answer."""
    client.send(refusal(status, why, close=client_close))
    return not client_close


class Exchange:
    """One HTTP/1.1 call at a time per agent connection: sent upstream on a pooled connection, answered back."""

    def __init__(self, calls: Calls, options: ProxyOptions, destinations: Destinations) -> None:
        self.calls = calls
        self.options = options
        self.destinations = destinations
        self.pool = UpstreamPool()

    def close(self) -> None:
        self.pool.close()

    async def forward(self, client: Connection, call: Call, upstream_head: bytes, client_close: bool) -> bool:
        """Forward one call and answer the agent; False when the agent's connection is done."""
        flight = _InFlight()
        reader = client.reader
        assert isinstance(reader, AgentReader)
        reader.notify(flight.agent_left)  # at once if the agent already closed (or half-closed) its side
        try:
            upstream, parts = await self._send(client, call, upstream_head, flight)
            reuse = await self._answer(client, call, upstream, parts, client_close, flight)
        except HoldRefused as refused:  # its turn is stored and counted already
            return _own_answer(client, 503, str(refused), client_close)
        except AnswerRefused as refused:  # its turn is stored already
            if flight.upstream is not None:
                flight.upstream.close()
            return _own_answer(client, 502, str(refused), client_close)
        except BaseException as exc:
            if flight.upstream is not None:
                flight.upstream.close()
            if flight.gone or isinstance(exc, _AgentGone):
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
                self.calls.failed(call.pending, f"{exc.__class__.__name__}: {exc}")
                status = 504 if isinstance(exc, _UpstreamTimeout) else 502
                why = f"upstream {call.scheme}://{call.host}:{call.port}: {exc.__class__.__name__}: {exc}"
                if isinstance(exc, (_UpstreamTimeout, _AnswerRefused)):
                    why = f"upstream {call.scheme}://{call.host}:{call.port}: {exc}"
            self.calls.close_call(call.pending, why)
            if call.pending.chunks is not None:  # a stream: the agent may have part of it, cut it off
                return False
            return _own_answer(client, status, why, client_close)
        finally:
            reader.notify(None)
        if reuse:
            self.pool.give_back((call.scheme, call.host, call.port), upstream)
        else:
            upstream.close()
        return reuse is not None and not client_close

    async def _send(
        self, client: Connection, call: Call, upstream_head: bytes, flight: _InFlight
    ) -> tuple[Connection, _ResponseParts]:
        """Send the call upstream and read its response head. While every policy replica restarts, the call
        waits for one to serve again (`Calls.hold`). A call that cannot reach a policy replica (no connection, or
        the connection closed before any answer: the replica never answered it) goes to the episode's next
        replica, the failed one leaving the rotation; at most once per replica. With no replica left to try it
        waits too if the record now says they all restart (it was sent before this proxy read that)."""
        while True:
            if self.calls.must_hold(call):
                if not await self.calls.hold(call, lambda: flight.gone):
                    raise _AgentGone
                upstream_head, _ = request_head(call)
            try:
                return await self._attempt(client, call, upstream_head, flight)
            except _Unreached as unreached:
                if flight.gone:
                    raise _AgentGone from None
                if self.calls.failover(call, str(unreached.error)):
                    upstream_head, _ = request_head(call)
                elif not self.calls.must_hold(call):
                    raise unreached.error from None

    async def _attempt(
        self, client: Connection, call: Call, upstream_head: bytes, flight: _InFlight
    ) -> tuple[Connection, _ResponseParts]:
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
            flight.upstream = upstream
            if flight.gone:
                raise _AgentGone
            try:
                return upstream, await _response_head(upstream, message, client, self.options)
            except _Stale:
                upstream.close()
                if flight.gone:
                    raise _AgentGone from None
                if not may_retry:
                    raise _Unreached(EOFError("the upstream closed the connection before answering")) from None
                upstream, may_retry = None, False

    async def _open(self, client: Connection, call: Call, key: tuple[str, str, int]) -> Connection:
        """A new upstream connection; the configured upstream is trusted, any other destination is checked."""
        timeout = self.options.connect_timeout
        try:
            with client.deadline(timeout, "connect"):
                address = key[1] if call.route is not None else await self.destinations.address(key[1], key[2])
                return await self.pool.open(key, address)
        except Expired:
            raise _UpstreamTimeout(f"no connection within {timeout:g} s (--connect-timeout)") from None

    async def _answer(
        self,
        client: Connection,
        call: Call,
        upstream: Connection,
        parts: _ResponseParts,
        client_close: bool,
        flight: _InFlight,
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
            await self._stream(client, upstream, parts, head, transform, framed, flight)
            if framed and not parts.complete:
                raise EOFError("the upstream closed the connection mid-stream")
            self.calls.close_call(call.pending)
        else:
            idle, limit = self.options.stream_idle_timeout, self.options.max_body_bytes
            while parts.size <= limit and not parts.complete:
                data = await _recv(upstream, client, idle)
                if not data:
                    if flight.gone:
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
        client: Connection,
        upstream: Connection,
        parts: _ResponseParts,
        head: bytes,
        transform: Callable[[bytes], bytes | list[bytes]],
        chunked: bool,
        flight: _InFlight,
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
                    if flight.gone:
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


class _Stale(Exception):
    """The upstream closed a kept-alive connection before any of the response came back."""


async def _recv(upstream: Connection, client: Connection, timeout: float) -> bytes:
    """The upstream's next bytes; `_UpstreamTimeout` when it is silent for `timeout` seconds."""
    try:
        with client.deadline(timeout, "upstream"):
            return await upstream.recv()
    except Expired:
        raise _UpstreamTimeout(
            f"silent for {timeout:g} s in the middle of its answer (--stream-idle-timeout)"
        ) from None


async def _response_head(
    upstream: Connection, message: bytes, client: Connection, options: ProxyOptions
) -> _ResponseParts:
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


def _send_now(client: Connection, out: list[bytes]) -> None:
    if not client.writer.is_closing():  # the hold's timer may fire after the agent left
        client.send(b"".join(out))
    out.clear()


def _frame(out: list[bytes], data: bytes | list[bytes], chunked: bool) -> None:
    for piece in [data] if isinstance(data, bytes) else data:
        if piece:
            out.append(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
