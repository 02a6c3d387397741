"""The front's middle layer: CONNECT tunnels, TLS terminated with lcap's CA, `--transparent` redirects, and the
hand-off of a connection to the embedded mitmproxy.

A CONNECT the front accepts becomes a `Tunnel`; what the agent sends in it decides the rest. A TLS ClientHello
offering HTTP/1.1 is answered with a certificate for its server name (capture/trust/certs.py) and the requests
inside are served by the front like any other (`serve`); plain HTTP in a tunnel is served as it is; anything else
(an HTTP/2-only offer, a protocol lcap does not read) is handed to mitmproxy unopened. A connection an agent's
namespace redirected to lcap is treated as a tunnel to where it was going, except a destination on the host's
loopback or a protocol where the server speaks first, which is passed through byte for byte, unstored. The
hand-off replays the CONNECT (and TLS) to mitmproxy on a loopback port it accepts only from the front
(`FrontOnly`), then splices the two connections for the rest of their life.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mitmproxy.tls import ClientHello

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.connections import READ_SIZE, Connection, Expired, TlsServerSide, original_destination
from lcap.capture.proxy.http1 import Refused, RequestHead
from lcap.capture.proxy.mitm_guards import read_client_hello
from lcap.capture.reach.names import Names
from lcap.capture.trust.certs import LeafCerts
from lcap.capture.trust.destinations import Destinations, Forbidden

log = logging.getLogger("lcap.capture")

# A redirected connection (`--transparent`) whose agent says nothing for this long is a protocol where the server
# speaks first (SSH, SMTP, MySQL, ...): it is passed through. On these ports it is at once (and DNS over TCP); on
# HTTP's ports, and to an address only lcap's DNS gave out, the agent speaks first however slowly it starts (a JVM
# under load may take seconds to its TLS hello).
FIRST_BYTES_WAIT = 3.0
PASS_THROUGH_PORTS = frozenset((21, 22, 25, 53, 110, 143, 587, 3306, 5900))
CLIENT_FIRST_PORTS = frozenset((80, 443, 8000, 8080, 8443))


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


class Tunnels:
    """Opens the agents' tunnels and redirected connections, and hands connections to mitmproxy on `mitm_port`."""

    def __init__(
        self,
        serve: Callable[[Connection, Tunnel | None, bytes], Awaitable[None]],
        mitm_port: int,
        certs: LeafCerts,
        options: ProxyOptions,
        destinations: Destinations,
        handoff_ports: dict[int, str | None],
        names: Names,
    ) -> None:
        """`serve(connection, tunnel, buf)`: serve the requests on a connection (the front's), `buf` read already;
        `handoff_ports`: the local ports of the front's connections to mitmproxy, the only ones mitmproxy serves
        (`FrontOnly`), and the episode each is known to belong to (its listener's, or its tunnel's) if any;
        `names`: the names lcap's DNS answered, for redirected connections."""
        self.serve = serve
        self.mitm_port = mitm_port
        self.certs = certs
        self.options = options
        self.destinations = destinations
        self.handoff_ports = handoff_ports
        self.names = names

    async def connect(
        self, client: Connection, head: RequestHead, episode: str | None, raw_head: bytes, buf: bytes
    ) -> None:
        """Accept a CONNECT; terminate TLS when the agent offers HTTP/1.1, else hand the tunnel on unopened."""
        host, _, port = head.target.decode("ascii", "replace").rpartition(":")
        if not host or not port.isdigit():
            return await self.hand_off(client, raw_head + buf, None)
        tunnel = Tunnel(host.strip("[]"), int(port), raw_head, episode)
        try:
            await self.destinations.check_tunnel(tunnel.host, tunnel.port)
        except Forbidden as exc:
            raise Refused(403, str(exc)) from None
        client.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
        return await self._open(client, tunnel, buf)

    async def _open(self, client: Connection, tunnel: Tunnel, buf: bytes) -> None:
        """What the agent sends in an open tunnel: TLS is terminated and plain HTTP served (LLM calls take the short
        path), anything else is handed to mitmproxy unopened."""
        try:
            with client.deadline(self.options.head_timeout, "tunnel"):
                data, hello = await self._client_hello(client, buf)
                tls = await self._terminate(client, tunnel, data, hello) if hello is not None else None
        except (Expired, EOFError):  # a tunnel that does not say what it carries in time, or the agent left
            return
        if tls is not None:
            return await self.serve(tls, tunnel, b"")
        tunnel.tls = False
        if hello is None and data[:1].isalpha():  # plain HTTP inside the tunnel
            return await self.serve(client, tunnel, data)
        return await self.hand_off(client, data, tunnel)  # spliced unopened: mitmproxy takes it from there

    async def redirected(self, client: Connection) -> None:
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
            await self._open(client, tunnel, data)

    async def _pass_through(self, client: Connection, host: str, port: int) -> None:
        """Relay the agent's connection to `host:port` byte for byte, nothing looked at or stored."""
        try:
            with client.deadline(self.options.connect_timeout, "connect"):
                reader, writer = await asyncio.open_connection(host, port, limit=READ_SIZE)
        except (Expired, OSError):
            return
        server = Connection(reader, writer)
        try:
            await _splice(client, server)
        finally:
            server.close()

    async def _client_hello(self, client: Connection, data: bytes) -> tuple[bytes, ClientHello | None]:
        """What the agent first sends in a tunnel, and its TLS ClientHello if it is TLS. EOFError: it left."""
        while True:
            try:
                hello = read_client_hello(data) if data else None
            except ValueError:  # not TLS
                return data, None
            if hello is not None or len(data) > self.options.max_head_bytes:
                return data, hello
            chunk = await client.recv()
            if not chunk:
                raise EOFError
            data += chunk

    async def _terminate(
        self, client: Connection, tunnel: Tunnel, data: bytes, hello: ClientHello
    ) -> TlsServerSide | None:
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

    async def hand_off(self, client: Connection, data: bytes, tunnel: Tunnel | None) -> None:
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
            mitm = Connection(reader, writer)
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


async def _pipe(src: Connection, dst: Connection) -> None:
    try:
        while data := await src.recv():
            dst.send(data)
            await dst.drain()
        dst.send_eof()
    except (ConnectionError, ssl.SSLError, OSError):
        dst.close()


async def _splice(a: Connection, b: Connection) -> None:
    """Relay both ways until both directions ended."""
    await asyncio.gather(_pipe(a, b), _pipe(b, a))
