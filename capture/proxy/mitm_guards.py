"""lcap's rules where the embedded mitmproxy carries the traffic the front handed it.

- `FrontOnly`: mitmproxy listens on a loopback port, but serves only the connections the front opened
  to it (told apart by their local port, registered before they connect); anything else that
  connects there is cut off before a byte is read, so the port is no way around the front's checks.
- `PrivateDestinations`: while the proxy is exposed, server connections go only to checked public
  addresses (`capture/trust/destinations.py`), pinned so that the address checked is the one connected to.
- `install_body_limits`: mitmproxy holds LLM requests, and the answers lcap records whole, in memory;
  these are bounded by `--max-body-bytes` like on the front (413 for a request, 502 for an answer),
  early by their Content-Length or as soon as a chunked body passes the limit. mitmproxy's own
  `body_size_limit` applies to every flow, downloads and uploads the agent makes included, so lcap
  replaces its check with one that asks `limit_for(flow, request)`; everything else streams, unbounded
  and unbuffered.
- `install_http1_guards`: where mitmproxy's HTTP/1 layer would hang or close without a word, an answer.
  A chunk size past 2^64 (which the front's parser, llhttp, refuses too) is a protocol error, and a
  request body mitmproxy cannot read gets its 400 before the connection closes (mitmproxy closed it
  first, so its 400 was never written). Trailers after a chunked body are dropped (RFC 9112 7.1.2 lets
  a recipient that removes the chunked coding discard them; mitmproxy raised NotImplementedError). An
  upstream's interim answer (100 Continue, 103 Early Hints) is skipped, so the answer proper that
  follows is the one relayed (the front does the same), where mitmproxy took the 1xx for the answer.
  Heads are bounded as on the front: an answer head past `--max-head-bytes` is a 502, one taking over
  `--head-timeout` after its first byte a 504; a request head past the limit a 431.
- `install_websocket_limits`, `install_reset_limit`: a WebSocket message past `--max-body-bytes` closes the
  socket with 1009; an agent resetting more than `--max-stream-resets` HTTP/2 streams within a second (a sliding
  window) gets GOAWAY, and a stream it reset before lcap read its request costs no flow. `Limits` hands each
  proxy's limits to these patches as options of its mitmproxy, and counts the connections closed.

Every other internal of mitmproxy lcap reads or sets is here too, behind a named function, so that an upgrade of
mitmproxy is ported in this one module (tests/unit/test_mitm_internals.py lists them and checks that no other
module touches them): `skip_debug_checks`, `quiet_tls_config`, `eager_tasks` (the proxy's start-up),
`bounded_lru` (the certificate cache), `connection_of` and `cut_upstream` (a call past its deadline) and
`read_client_hello` (the front's tunnels).
"""

from __future__ import annotations

import copy
import functools
import logging
import re
import time
import zlib
from collections import deque
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import h2.connection
import h2.errors
import h2.events
import h11
import wsproto.events
from h11._readers import ChunkedReader
from mitmproxy import flow as mflow
from mitmproxy import http, optmanager
from mitmproxy.net.http.http1 import expected_http_body_size
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers import http as mhttp
from mitmproxy.proxy.layers import tls, websocket
from mitmproxy.proxy.layers.http import RequestProtocolError, _http1, _http2
from mitmproxy.proxy.utils import expect
from mitmproxy.tls import ClientHello
from mitmproxy.utils import asyncio_utils
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.refusals import UNASKED_SWITCH
from lcap.capture.routing.routes import Router
from lcap.capture.trust.destinations import Destinations, Forbidden

log = logging.getLogger("lcap.capture")


class FrontOnly:
    """mitmproxy's `client_connected`: only the front's own connections (their local ports are keys of `ports`).
    The front also says which episode each one belongs to, when it knows (an episode's own listener, a tunnel it
    attributed): `episode` gives it to the capture addon, so a handed-off connection needs no credentials."""

    def __init__(self, ports: dict[int, str | None]) -> None:
        self.ports = ports
        self.refused = 0

    def client_connected(self, client: Any) -> None:
        peer = client.peername
        if not (isinstance(peer, tuple) and peer[0] == "127.0.0.1" and peer[1] in self.ports):
            self.refused += 1
            client.error = "lcap: mitmproxy only serves lcap's front"

    def episode(self, client: Any) -> str | None:
        peer = client.peername
        return self.ports.get(peer[1]) if isinstance(peer, tuple) else None


class Limits:
    """mitmproxy's `load`: lcap's limits become options of this proxy's mitmproxy, which the layers patched here
    read from their context (the patches are the process's, the limits each proxy's own). `stream_reset_flood`:
    an agent connection closed by `install_reset_limit`, logged and counted for this proxy's counters."""

    def __init__(self, options: ProxyOptions) -> None:
        self.options = options
        self.reset_floods = 0

    def stream_reset_flood(self, client: Any) -> None:
        self.reset_floods += 1
        log.warning(
            "lcap: an agent connection reset over %d HTTP/2 streams in %g s and was closed (GOAWAY, "
            "ENHANCE_YOUR_CALM; --max-stream-resets)",
            self.options.max_stream_resets,
            RESET_WINDOW_S,
        )

    def load(self, loader: Any) -> None:
        o = self.options
        loader.add_option("lcap_max_head_bytes", int, o.max_head_bytes, "lcap: --max-head-bytes")
        loader.add_option("lcap_head_timeout", float, o.head_timeout, "lcap: --head-timeout")
        loader.add_option("lcap_max_message_bytes", int, o.max_body_bytes, "lcap: --max-body-bytes")
        loader.add_option("lcap_max_stream_resets", int, o.max_stream_resets, "lcap: --max-stream-resets")


def _limit(options: Any, name: str) -> Any:
    """One of `Limits`' options; None where no `Limits` was loaded (mitmproxy used without lcap's proxy)."""
    return getattr(options, name, None)


class PrivateDestinations:
    """mitmproxy's `server_connect`: an exposed proxy connects to checked public addresses only; the configured
    upstream is trusted."""

    def __init__(self, destinations: Destinations, router: Router) -> None:
        self.destinations = destinations
        self.router = router

    async def server_connect(self, data: Any) -> None:
        if not self.destinations.restricted or data.server.address is None:
            return
        host, port = data.server.address[:2]
        if self.router.trusted(host, port):
            return
        try:
            address = await self.destinations.address(host, port)
        except Forbidden as exc:
            data.server.error = str(exc)
            return
        except OSError:
            return  # a name that does not resolve: mitmproxy's own connection fails the same way
        if address != host:
            if data.server.sni is None:
                data.server.sni = host
            data.server.address = (address, port)


def install_body_limits(limit_for: Callable[[Any, bool], int | None]) -> None:
    """Make mitmproxy's body-size check per flow: `limit_for(flow, request)` is the largest body mitmproxy may
    hold for it (None: no limit). Installed once per process; the last `limit_for` is used."""
    global _limit_for
    _limit_for = limit_for
    if getattr(mhttp.HttpStream.check_body_size, "lcap", False):
        return

    def check_body_size(self: Any, request: bool):  # mitmproxy's HttpStream.check_body_size, with lcap's limit
        """True when the body is over the flow's limit: the flow ends with 413 (request) or 502 (answer)."""
        limit = _limit_for(self.flow, request)
        if limit is None:
            return False
        buffered = self.request_body_buf if request else self.response_body_buf
        size: int | None
        if buffered:
            size = len(buffered)
        else:
            try:
                size = expected_http_body_size(self.flow.request, None if request else self.flow.response)
            except ValueError:
                size = None
        if size is None or size <= limit:
            return False
        if not buffered:
            yield mhttp.HttpRequestHeadersHook(self.flow) if request else mhttp.HttpResponseHeadersHook(self.flow)
        what = "request body" if request else "answer"
        message = f"lcap: {what} over the limit of {limit} bytes (--max-body-bytes)"
        status = 413 if request else 502
        self.flow.error = mflow.Error(message)
        yield mhttp.HttpErrorHook(self.flow)
        yield mhttp.SendHttp(mhttp.ResponseProtocolError(self.stream_id, message, status), self.context.client)
        self.client_state = self.state_errored
        if not request:
            yield mhttp.SendHttp(mhttp.RequestProtocolError(self.stream_id, message, status), self.context.server)
            self.server_state = self.state_errored
        self.flow.live = False
        return True

    check_body_size.lcap = True  # type: ignore[attr-defined]
    mhttp.HttpStream.check_body_size = check_body_size  # type: ignore[method-assign]  # a deliberate patch


_limit_for: Callable[[Any, bool], int | None]  # set by `install_body_limits` before its patch is in place


_INTERIM = re.compile(rb"HTTP/1\.[01] 1(?!01)[0-9][0-9][ \r\n]")  # a 1xx head other than 101 Switching Protocols
_SWITCH = re.compile(rb"HTTP/1\.[01] 101[ \r\n]")
MAX_CHUNK_SIZE = 2**64 - 1
MAX_ECHOED = 200  # bytes of an unreadable answer head that mitmproxy's error (the agent's 502, the turn) quotes


def install_http1_guards() -> None:
    """Patch mitmproxy's HTTP/1 layer as the module's docstring says. Installed once per process."""
    if getattr(_http1.Http1Client.read_headers, "lcap", False):
        return
    skip_interim = _skip_interim(_http1.Http1Client.read_headers)
    skip_interim.lcap = True  # type: ignore[attr-defined]
    _http1.ChunkedReader = BoundedChunkedReader  # type: ignore[misc]  # make_body_reader's reader
    _http1.Http1Client.read_headers = skip_interim  # type: ignore[method-assign]  # deliberate patches
    _http1.Http1Server.read_headers = _bounded_request_head(  # type: ignore[method-assign]
        _http1.Http1Server.read_headers
    )
    _http1.Http1Server.read_body = _answer_then_close(_http1.Http1Connection.read_body)  # type: ignore[method-assign]


class BoundedChunkedReader(ChunkedReader):
    """h11's chunked body reader, refusing a chunk size past 2^64 and dropping trailers."""

    def __call__(self, buf: Any) -> Any:
        event = super().__call__(buf)
        size = self._bytes_in_chunk  # what is left of the chunk: all of it when the chunk began here
        if isinstance(event, h11.Data) and event.chunk_start:
            size += len(event.data)
        if size > MAX_CHUNK_SIZE:
            raise h11.RemoteProtocolError("chunk size past 2^64")
        if isinstance(event, h11.EndOfMessage) and event.headers:
            return h11.EndOfMessage()
        return event


def _skip_interim(read_headers: Callable[..., Any]) -> Callable[..., Any]:
    """mitmproxy's Http1Client.read_headers, past any 1xx but 101, its answer head bounded in size and time."""

    def skip_interim(self: Any, event: Any):
        if isinstance(event, events.DataReceived) and self.request is not None:
            began = self.__dict__.setdefault("lcap_head_began", time.monotonic())
            while _INTERIM.match(bytes(self.buf._data[:16])):
                if self.buf.maybe_extract_lines() is None:
                    break  # the rest of the interim head is still to come
            if _SWITCH.match(bytes(self.buf._data[:16])) and "upgrade" not in self.request.headers:
                yield commands.CloseConnection(self.conn)
                yield mhttp.ReceiveHttp(mhttp.ResponseProtocolError(self.stream_id, UNASKED_SWITCH))
                return
            timeout = _limit(self.context.options, "lcap_head_timeout")
            if timeout is not None and time.monotonic() - began > timeout:
                why = f"lcap: the upstream's answer head took over {timeout:g} s (--head-timeout)"
                yield commands.CloseConnection(self.conn)
                yield mhttp.ReceiveHttp(mhttp.ResponseProtocolError(self.stream_id, why, 504))
                return
            if _INTERIM.match(bytes(self.buf._data[:16])):
                return
        elif isinstance(event, events.ConnectionClosed) and len(self.buf) > MAX_ECHOED:
            del self.buf._data[MAX_ECHOED:]  # mitmproxy's error quotes what the upstream sent: its start is enough
        yield from read_headers(self, event)
        if self.state == self.read_headers and self.response is None:
            limit = _limit(self.context.options, "lcap_max_head_bytes")
            if limit is not None and len(self.buf) > limit:
                why = f"lcap: the upstream's answer head is over {limit} bytes (--max-head-bytes)"
                self.buf._data.clear()
                yield commands.CloseConnection(self.conn)
                yield mhttp.ReceiveHttp(mhttp.ResponseProtocolError(self.stream_id, why))
        else:
            self.__dict__.pop("lcap_head_began", None)

    return skip_interim


def _bounded_request_head(read_request_head: Callable[..., Any]) -> Callable[..., Any]:
    """mitmproxy's Http1Server.read_headers, with the front's limit."""

    def bounded_request_head(self: Any, event: Any):
        """A request head on a connection mitmproxy carries (the front read only the first) is bounded as on the
        front: past `--max-head-bytes`, a 431 and the connection closes."""
        yield from read_request_head(self, event)
        limit = _limit(self.context.options, "lcap_max_head_bytes")
        if self.state == self.read_headers and limit is not None and len(self.buf) > limit:
            self.buf._data.clear()
            why = f"lcap: request head over {limit} bytes (--max-head-bytes)"
            yield commands.SendData(self.conn, _http1.make_error_response(431, why))
            yield commands.CloseConnection(self.conn)
            self.state = self.done

    return bounded_request_head


def _answer_then_close(read_body: Callable[..., Any]) -> Callable[..., Any]:
    """mitmproxy's read_body, for the agent's side."""

    def answer_then_close(self: Any, event: Any):
        """A request body mitmproxy cannot read (a bad chunk size) is answered 400 before the connection closes;
        mitmproxy closes it first, so its own 400 is never written."""
        body = read_body(self, event)
        held, reply = None, None
        while True:
            try:
                command = body.send(reply)
            except StopIteration:
                break
            if held is None and isinstance(command, commands.CloseConnection):
                held, reply = command, None
                continue
            if held is not None:
                error = getattr(command, "event", None)
                if isinstance(error, RequestProtocolError) and not self.response:
                    yield commands.SendData(self.conn, _http1.make_error_response(error.code, error.message))
                yield held
                held = None
            reply = yield command
        if held is not None:
            yield held

    return answer_then_close


def install_websocket_limits() -> None:
    """Bound what mitmproxy holds of a WebSocket message (it keeps a whole message before relaying it): past
    `--max-body-bytes`, counted as it arrives (inflated, with permessage-deflate), both sides get a close with 1009
    (message too big) and lcap's reason instead of the rest. Installed once per process."""
    if getattr(websocket.WebsocketLayer, "lcap", False):
        return

    class BoundedWebsocketLayer(websocket.WebsocketLayer):
        lcap = True

        @expect(events.Start)
        def start(self, event: Any):
            yield from super().start(event)
            limit = _limit(self.context.options, "lcap_max_message_bytes")
            if limit is None:
                return
            for ws, sender in ((self.client_ws, "agent"), (self.server_ws, "upstream")):
                ws.events = MessageBound(ws.events, limit, sender)  # type: ignore[method-assign]
                for extension in ws._proto.extensions:
                    if isinstance(extension, PerMessageDeflate):
                        extension.frame_inbound_payload_data = functools.partial(  # type: ignore[method-assign]
                            _bounded_inflate, extension, limit
                        )

        _handle_event = start

    websocket.WebsocketLayer = BoundedWebsocketLayer  # type: ignore[misc]  # a deliberate patch: the HTTP layer's


class MessageBound:
    """A WebSocket connection's `events()`, each message counted as its pieces arrive: past `limit` bytes, a close
    (1009) with lcap's reason instead of the rest."""

    def __init__(self, events: Callable[[], Iterator[Any]], limit: int, sender: str) -> None:
        self.events, self.limit = events, limit
        self.reason = f"lcap: a message from the {sender} over {limit} bytes (--max-body-bytes)"
        self.size = 0

    def __call__(self) -> Generator[Any, None, None]:
        for event in self.events():
            if isinstance(event, wsproto.events.Message):
                data = event.data
                self.size += len(data) if isinstance(data, bytes) or data.isascii() else len(data.encode())
                if self.size > self.limit:
                    yield wsproto.events.CloseConnection(CloseReason.MESSAGE_TOO_BIG, self.reason)
                    return
                if event.message_finished:
                    self.size = 0
            elif isinstance(event, wsproto.events.CloseConnection) and event.reason == _TOO_BIG_TO_INFLATE:
                event = wsproto.events.CloseConnection(CloseReason.MESSAGE_TOO_BIG, self.reason)
            yield event


_TOO_BIG_TO_INFLATE = "error in extension"  # wsproto's reason when `_bounded_inflate` refuses


def _bounded_inflate(extension: PerMessageDeflate, limit: int, proto: Any, data: bytes) -> bytes | CloseReason:
    """wsproto's permessage-deflate inflation of a frame's payload, at most `limit` + 1 bytes of it at a time."""
    if not extension._inbound_compressed or not extension._inbound_is_compressible:
        return data
    assert extension._decompressor is not None
    try:
        out = extension._decompressor.decompress(bytes(data), limit + 1)
    except zlib.error:
        return CloseReason.INVALID_FRAME_PAYLOAD_DATA
    if extension._decompressor.unconsumed_tail:
        return CloseReason.MESSAGE_TOO_BIG
    return out


RESET_WINDOW_S = 1.0  # the sliding window `--max-stream-resets` counts an agent connection's stream resets in
H2_SLICE_BYTES = 4096  # what an agent sent is parsed this much at a time, its resets counted between the pieces


@dataclass
class StreamResetFloodHook(commands.StartHook):
    """An agent connection was closed for resetting more than `--max-stream-resets` HTTP/2 streams in
    `RESET_WINDOW_S` (`Limits.stream_reset_flood` logs and counts it)."""

    client: Any
    blocking = False


def install_reset_limit() -> None:
    """HTTP/2 rapid reset (CVE-2023-44487), on mitmproxy's side of an agent's HTTP/2 connection:
    - an agent that resets more than `--max-stream-resets` streams within any `RESET_WINDOW_S` on one connection has
      it closed (GOAWAY, ENHANCE_YOUR_CALM), counted and logged (`StreamResetFloodHook`);
    - what the agent sends is parsed `H2_SLICE_BYTES` at a time with the count between the pieces, so the flood is
      cut within a slice of the bound, not after all that one read brought (thousands of streams);
    - a stream the agent reset before lcap looked at its request (its HEADERS and RST_STREAM in one read) is
      dropped there: no flow, no hook, no upstream call, only its reset counted.
    Installed once per process."""
    handle_event = _http2.Http2Server._handle_event
    if getattr(handle_event, "lcap", False):
        return
    handle_h2_event = _http2.Http2Server.handle_h2_event

    def sliced(self: Any, event: Any):  # mitmproxy's Http2Server._handle_event, an agent's bytes a slice at a time
        if not isinstance(event, events.DataReceived) or len(event.data) <= H2_SLICE_BYTES:
            return (yield from handle_event(self, event))
        data = event.data
        for at in range(0, len(data), H2_SLICE_BYTES):
            if self.h2_conn.state_machine.state is h2.connection.ConnectionState.CLOSED:
                return  # closed by what an earlier slice held: the rest is not read
            yield from handle_event(self, events.DataReceived(event.connection, data[at : at + H2_SLICE_BYTES]))

    def count_resets(self: Any, event: Any):  # mitmproxy's Http2Server.handle_h2_event, counting client resets
        if isinstance(event, h2.events.RequestReceived) and self.is_closed(event.stream_id):
            return False  # reset (or the connection closed) already: nobody waits for its answer
        if isinstance(event, h2.events.TrailersReceived) and event.stream_id not in self.streams:
            return False  # the trailers of a stream dropped above
        if isinstance(event, h2.events.StreamReset):
            cap = _limit(self.context.options, "lcap_max_stream_resets")
            if cap:
                resets = self.__dict__.get("lcap_resets")
                if resets is None or resets.maxlen != cap + 1:
                    resets = self.__dict__["lcap_resets"] = deque(maxlen=cap + 1)
                now = time.monotonic()
                resets.append(now)
                if len(resets) > cap and now - resets[0] < RESET_WINDOW_S:
                    why = f"lcap: over {cap} stream resets in {RESET_WINDOW_S:g} s (--max-stream-resets)"
                    yield StreamResetFloodHook(self.conn)
                    yield from self.protocol_error(why, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
                    return True
        return (yield from handle_h2_event(self, event))

    sliced.lcap = True  # type: ignore[attr-defined]
    _http2.Http2Server._handle_event = sliced  # type: ignore[method-assign]  # deliberate patches
    _http2.Http2Server.handle_h2_event = count_resets  # type: ignore[method-assign]


# --- the proxy's start-up -------------------------------------------------------------------------


def skip_debug_checks() -> None:
    """Skip two pieces of per-call work mitmproxy does for its own debugging (benchmarks/count_proxy_instructions.py
    counts their share of each proxied call): a runtime type check of every field of every Request and
    Response it builds, which Python's -O already removes (`if __debug__`), and a deep copy of an option's
    value on every read, which lcap keeps only for mutable values."""
    if optmanager._Option.current is _current_option:
        return
    http.MessageData.__post_init__ = lambda self: None  # type: ignore[method-assign]  # a deliberate patch
    optmanager._Option.current = _current_option  # type: ignore[method-assign,assignment]  # a deliberate patch


def _current_option(option: Any) -> Any:
    """mitmproxy's `_Option.current` without the deep copy of immutable values."""
    value = option._default if option.value is optmanager.unset else option.value
    return value if isinstance(value, _IMMUTABLE) else copy.deepcopy(value)


_IMMUTABLE = (str, bytes, int, float, bool, type(None))


def quiet_tls_config() -> Any:
    """mitmproxy's TLS addon, less the CA reload it does again once running."""
    from mitmproxy.addons import tlsconfig  # start-up: mitmproxy's addons, which only a running proxy needs

    class TlsConfig(tlsconfig.TlsConfig):  # its class name is its addon name, "tlsconfig", which lcap looks up
        def running(self) -> None:
            """Upstream reloads the CA here again, a workaround lcap does not need: it slows every start."""

    return TlsConfig()


def eager_tasks() -> AbstractContextManager[None]:
    """mitmproxy's eager task factory on the running loop, for the block."""
    return asyncio_utils.set_eager_task_factory()


def bounded_lru(store: Any, max_certs: int) -> Any:
    """Make a mitmproxy `CertStore` keep the `max_certs` certificates used last. Its own bound (`STORE_CAP`)
    drops the one made first, even a host every call goes to; here each hit moves its entry to the back of the
    store's expiry queue, so the one used least recently goes instead."""
    store.STORE_CAP = max_certs
    get_cert = store.get_cert

    def get_cert_lru(*args: Any, **kwargs: Any) -> Any:
        entry = get_cert(*args, **kwargs)
        queue = store.expire_queue
        if queue and queue[-1] is not entry:
            at = next((i for i, e in enumerate(queue) if e is entry), None)  # by identity: entries compare by value
            if at is not None:  # a made certificate (the CA's own is not in the queue)
                queue.append(queue.pop(at))
        return entry

    store.get_cert = get_cert_lru
    return store


# --- a call past its deadline, a tunnel's first bytes ------------------------------------------------


def connection_of(proxyserver: Any, flow: http.HTTPFlow) -> Any | None:
    """mitmproxy's handler of `flow`'s agent connection; None once it is gone."""
    return proxyserver.connections.get(flow.client_conn.id)


def cut_upstream(handler: Any, flow: http.HTTPFlow) -> None:
    """Cut `flow`'s server connection (mitmproxy answers 502 and calls `error`); while it is still connecting,
    only the agent's connection can be cut."""
    if flow.server_conn in handler.transports:
        handler.close_connection(flow.server_conn)
    else:
        handler.close_connection(flow.client_conn)


def read_client_hello(data: bytes) -> ClientHello | None:
    """The TLS ClientHello at the start of `data`; None while it is incomplete; ValueError: not TLS."""
    return tls.parse_client_hello(data)
