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

The front is three layers, one class each: `Front` here, the listener (accept, admit, per-client limits, each
request head read and refused or dispatched); `Tunnels` (capture/proxy/tunnel.py: CONNECT, TLS termination,
`--transparent` redirects, the hand-off to mitmproxy); `Exchange` (capture/proxy/exchange.py: one HTTP/1.1 call
upstream and its answer streamed back).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.calls import Calls
from lcap.capture.proxy.connections import READ_SIZE, Admission, AgentReader, Connection, Expired, Watches
from lcap.capture.proxy.exchange import Exchange, request_head
from lcap.capture.proxy.http1 import (
    HEAD_END,
    PROXY_AUTHENTICATE,
    BadRequest,
    Refused,
    RequestHead,
    not_a_head,
    parse_request_head,
    refusal,
)
from lcap.capture.proxy.refusals import BodyRefused, NoRoute, Unauthorized
from lcap.capture.proxy.tunnel import Tunnel, Tunnels
from lcap.capture.reach.listeners import Admit
from lcap.capture.reach.names import Names
from lcap.capture.trust.certs import LeafCerts
from lcap.capture.trust.credentials import HeaderFields
from lcap.capture.trust.destinations import Destinations
from lcap.capture.turns import dialects

log = logging.getLogger("lcap.capture")

LINGER = 1.0  # seconds a refused connection is read (and discarded) before it closes, so the agent reads the answer
MAX_LINGERING = 64


class Unserved(Exception):
    """The short path does not serve this request: mitmproxy gets the connection."""


class Front:
    """The listener agents connect to: accepts and admits their connections (`Admission`: per client, per episode,
    in all) and reads each request on them; a CONNECT or a redirected connection goes to `Tunnels`, an LLM call to
    `Exchange`, anything else to mitmproxy on `mitm_port`."""

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
        """`handoff_ports`: the local ports of the front's connections to mitmproxy (`Tunnels`); `names`: the names
        lcap's DNS answered (`--transparent`)."""
        self.calls = calls
        self.options = options
        self.admission = Admission(
            options.max_connections, options.max_client_connections, options.max_episode_connections
        )
        self.exchange = Exchange(calls, options, destinations)
        self.tunnels = Tunnels(self._serve, mitm_port, certs, options, destinations, handoff_ports, names)
        self.server: asyncio.Server | None = None
        self.watches = Watches()  # the deadlines of every agent connection's waits
        self._lingering = 0

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(_agent_protocol(loop, self._connection), host, port, backlog=512)
        self.watches.start(loop)
        return self.server.sockets[0].getsockname()[1]

    async def listen_episode(
        self, episode: str, sock: socket.socket | None = None, *, redirected: bool = False, admit: Admit | None = None
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
        self.exchange.close()

    async def _connection(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        episode: str | None = None,
        redirected: bool = False,
        admit: Admit | None = None,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = self.watches.add(task)
        client = Connection(reader, writer, watch)
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
                    await self.tunnels.redirected(client)
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

    async def _refuse(self, client: Connection, refused: Refused) -> None:
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

    async def _serve(self, client: Connection, tunnel: Tunnel | None, buf: bytes) -> None:
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
                    episode, role, fields = self.calls.attribute(
                        head.fields, tunnel.episode if tunnel else client.episode
                    )
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
                        return await self.tunnels.hand_off(client, raw_head + buf, tunnel)
                    return await self.tunnels.connect(client, head, episode, raw_head, buf)
                try:
                    if why := head.unserved():
                        raise Unserved(why)
                    target = _target(head, tunnel)
                except Unserved:
                    return await self.tunnels.hand_off(client, raw_head + buf, tunnel)
                rest = await self._take_call(client, tunnel, head, target, (episode, role), fields, raw_head, buf)
                if rest is None:
                    return
                buf = rest
        except Refused as refused:
            await self._refuse(client, refused)

    async def _take_call(
        self,
        client: Connection,
        tunnel: Tunnel | None,
        head: RequestHead,
        target: tuple[str, str, str, int, str],
        attributed: tuple[str | None, str | None],  # the episode and the role `Calls.attribute` found
        fields: HeaderFields,
        raw_head: bytes,
        buf: bytes,
    ) -> bytes | None:
        """Read the call's body and forward it; the bytes after it (a pipelined request), or None when the
        agent's connection is done."""
        dialect, scheme, host, port, path = target
        try:  # before the body: clients often write it separately, and this work is then done while it comes
            call = self.calls.open_call(
                dialect, *attributed, scheme=scheme, host=host, port=port, path=path, fields=fields
            )
            upstream_head, client_close = request_head(call)
        except NoRoute as exc:
            raise Refused(503, str(exc)) from None
        except Exception:  # a capture bug: mitmproxy takes the call (and refuses it rather than leak it when rerouted)
            log.exception("lcap: capture error on %s (the call goes through mitmproxy)", path)
            await self.tunnels.hand_off(client, raw_head + buf, tunnel)
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
                upstream_head, client_close = request_head(call)
        except BodyRefused as refused:  # its turn is stored already
            raise Refused(refused.status, str(refused)) from None
        except Exception:
            log.exception("lcap: capture error on %s (the call goes through mitmproxy)", path)
            is_call = False
        if not is_call:  # a side call on an LLM path (or a capture bug): mitmproxy sends it on, to the route if any
            await self.tunnels.hand_off(client, raw_head + body + buf, tunnel)
            return None
        if not await self.exchange.forward(client, call, upstream_head, client_close):
            return None
        return buf

    async def _next_head(self, client: Connection, buf: bytes) -> tuple[bytes, bytes] | None:
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

    async def _body(self, client: Connection, buf: bytes, length: int) -> bytes | None:
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


def _agent_protocol(
    loop: asyncio.AbstractEventLoop, handle: Callable[..., Awaitable[None]]
) -> Callable[[], asyncio.StreamReaderProtocol]:
    """The protocol factory of a listener for agents: each connection's reader is an `AgentReader`."""
    return lambda: asyncio.StreamReaderProtocol(AgentReader(limit=READ_SIZE, loop=loop), handle, loop=loop)


async def _admitted(admit: Admit, writer: asyncio.StreamWriter) -> bool:
    """`admit(listener, peer)`, off the event loop (it reads /proc)."""
    own, peer = writer.get_extra_info("sockname"), writer.get_extra_info("peername")
    if not isinstance(own, tuple) or not isinstance(peer, tuple):
        return False
    return await asyncio.get_running_loop().run_in_executor(None, admit, own[:2], peer[:2])


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
