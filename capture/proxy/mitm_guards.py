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
  and unbuffered, as before.
- `install_http1_guards`: where mitmproxy's HTTP/1 layer would hang or close without a word, an answer.
  A chunk size past 2^64 (which the front's parser, llhttp, refuses too) is a protocol error, and a
  request body mitmproxy cannot read gets its 400 before the connection closes (mitmproxy closed it
  first, so its 400 was never written). Trailers after a chunked body are dropped (RFC 9112 7.1.2 lets
  a recipient that removes the chunked coding discard them; mitmproxy raised NotImplementedError). An
  upstream's interim answer (100 Continue, 103 Early Hints) is skipped, so the answer proper that
  follows is the one relayed (the front does the same), where mitmproxy took the 1xx for the answer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import h11
from h11._readers import ChunkedReader
from mitmproxy import flow as mflow
from mitmproxy.net.http.http1 import expected_http_body_size
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers import http as mhttp
from mitmproxy.proxy.layers.http import RequestProtocolError, _http1

from lcap.capture.proxy.calls import UNASKED_SWITCH
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
        if request and not buffered:
            yield mhttp.HttpRequestHeadersHook(self.flow)
        if not request and not buffered:
            yield mhttp.HttpResponseHeadersHook(self.flow)
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


def _no_limit(flow: Any, request: bool) -> int | None:
    return None


_limit_for: Callable[[Any, bool], int | None] = _no_limit


_INTERIM = re.compile(rb"HTTP/1\.[01] 1(?!01)[0-9][0-9][ \r\n]")  # a 1xx head other than 101 Switching Protocols
_SWITCH = re.compile(rb"HTTP/1\.[01] 101[ \r\n]")
MAX_CHUNK_SIZE = 2**64 - 1


def install_http1_guards() -> None:
    """Patch mitmproxy's HTTP/1 layer as the module's docstring says. Installed once per process."""
    if getattr(_http1.Http1Client.read_headers, "lcap", False):
        return

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

    read_headers = _http1.Http1Client.read_headers

    def skip_interim(self: Any, event: Any):  # mitmproxy's Http1Client.read_headers, past any 1xx but 101
        if isinstance(event, events.DataReceived) and self.request is not None:
            while _INTERIM.match(bytes(self.buf._data[:16])):
                if self.buf.maybe_extract_lines() is None:
                    return  # the rest of the interim head is still to come
            if _SWITCH.match(bytes(self.buf._data[:16])) and "upgrade" not in self.request.headers:
                yield commands.CloseConnection(self.conn)
                yield mhttp.ReceiveHttp(mhttp.ResponseProtocolError(self.stream_id, UNASKED_SWITCH))
                return
        yield from read_headers(self, event)

    read_body = _http1.Http1Connection.read_body

    def answer_then_close(self: Any, event: Any):  # mitmproxy's read_body, for the agent's side
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

    skip_interim.lcap = True  # type: ignore[attr-defined]
    _http1.ChunkedReader = BoundedChunkedReader  # type: ignore[misc]  # make_body_reader's reader
    _http1.Http1Client.read_headers = skip_interim  # type: ignore[method-assign]  # deliberate patches
    _http1.Http1Server.read_body = answer_then_close  # type: ignore[method-assign]
