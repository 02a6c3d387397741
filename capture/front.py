"""The listener agents talk to: plain HTTP/1.1 LLM calls take a short path, everything else goes to mitmproxy.

mitmproxy's per-call machinery (protocol layers, event dispatch, hook plumbing) costs a few
milliseconds per call on a small machine, more than a proxy in front of an LLM may add. The front
serves the common case itself: an HTTP/1.1 POST to an LLM path with a Content-Length body, in the
clear or inside a CONNECT tunnel whose TLS it terminates with lcap's CA. What happens to the call
itself (attribution, rerouting, recording) is `Calls` (capture/calls.py), which the mitmproxy addon
drives too, so capture has one implementation.

Any connection it does not serve in full is handed to the embedded mitmproxy together with the bytes
read so far, and spliced there for the rest of its life: an HTTP/2-only or non-TLS tunnel, an
upgrade (Responses over WebSocket), `Expect`, a chunked or compressed request body, a request that
is not an LLM call (telemetry, model lists), a head it does not parse exactly. Traffic never
depends on the short path.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import ssl
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httptools
from mitmproxy.proxy.layers.tls import parse_client_hello

from lcap.capture import dialects
from lcap.capture.calls import Call, Calls, take_episode

log = logging.getLogger("lcap.capture")

READ_SIZE = 65536
MAX_HEAD = 65536
HEAD_HOLD = 0.001  # seconds a streamed answer's head may wait for its first piece of body (see `_stream`)


class Plain:
    """A TCP connection as the front uses it: recv / send / drain / close."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def recv(self) -> bytes:
        return await self.reader.read(READ_SIZE)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()

    def send_eof(self) -> None:
        if self.writer.can_write_eof() and not self.writer.is_closing():
            self.writer.write_eof()
        else:  # a TLS stream cannot half-close
            self.close()

    def close(self) -> None:
        self.writer.close()


class TlsServerSide(Plain):
    """The agent's side of an intercepted tunnel, TLS done in memory so the ClientHello can be read first."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: ssl.SSLContext) -> None:
        super().__init__(reader, writer)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)

    async def handshake(self, client_hello: bytes) -> None:
        self.incoming.write(client_hello)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                data = await self.reader.read(READ_SIZE)
                if not data:
                    raise ConnectionError("the agent closed the connection during the TLS handshake") from None
                self.incoming.write(data)
        self._flush()

    async def recv(self) -> bytes:
        while True:
            if self.incoming.pending or self.tls.pending():  # else reading would only raise SSLWantReadError
                try:
                    return self.tls.read(READ_SIZE)
                except ssl.SSLWantReadError:
                    pass
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    return b""
            self._flush()
            data = await self.reader.read(READ_SIZE)
            if not data:
                return b""
            self.incoming.write(data)

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    def send_eof(self) -> None:
        self.close()

    def _flush(self) -> None:
        if out := self.outgoing.read():
            self.writer.write(out)


# --- certificates ---------------------------------------------------------------------------------


class LeafCerts:
    """TLS server contexts for intercepted hosts, signed by lcap's CA (one per host, made on first use)."""

    def __init__(self, confdir: Path, basename: str) -> None:
        from mitmproxy.certs import CertStore

        self.store = CertStore.from_store(confdir, basename, 2048)
        self.contexts: dict[str, ssl.SSLContext] = {}

    def context(self, host: str) -> ssl.SSLContext:
        ctx = self.contexts.get(host)
        if ctx is None:
            ctx = self.contexts[host] = self._make(host)
        return ctx

    def pem(self, host: str) -> tuple[bytes, bytes]:
        """The certificate chain for `host` and its private key, PEM-encoded."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            name = x509.DNSName(host.encode("idna").decode())
        entry = self.store.get_cert(host, [name])
        key = entry.privatekey.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return entry.cert.to_pem() + b"".join(c.to_pem() for c in entry.chain_certs), key

    def _make(self, host: str) -> ssl.SSLContext:
        chain, key = self.pem(host)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.set_alpn_protocols(["http/1.1"])
        with tempfile.TemporaryDirectory(prefix="lcap-leaf-") as tmp:  # ssl loads key pairs from files only
            cert_file, key_file = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            cert_file.write_bytes(chain)
            key_file.touch(0o600)
            key_file.write_bytes(key)
            ctx.load_cert_chain(cert_file, key_file)
        return ctx


# --- upstream connections -------------------------------------------------------------------------


class UpstreamPool:
    """Keep-alive connections to upstreams, reused call after call."""

    def __init__(self) -> None:
        self.idle: defaultdict[tuple[str, str, int], list[Plain]] = defaultdict(list)
        self._tls: ssl.SSLContext | None = None

    def take(self, key: tuple[str, str, int]) -> Plain | None:
        idle = self.idle[key]
        while idle:
            conn = idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing() and not _buffered(conn.reader):
                return conn
            conn.close()
        return None

    async def open(self, key: tuple[str, str, int]) -> Plain:
        scheme, host, port = key
        tls = self._tls_context() if scheme == "https" else None
        reader, writer = await asyncio.open_connection(
            host, port, ssl=tls, server_hostname=host if tls else None, limit=MAX_HEAD
        )
        return Plain(reader, writer)

    def give_back(self, key: tuple[str, str, int], conn: Plain) -> None:
        self.idle[key].append(conn)

    def _tls_context(self) -> ssl.SSLContext:
        """Verified against certifi's roots, as mitmproxy verifies upstreams: one trust store for both paths."""
        if self._tls is None:
            import certifi  # a dependency of mitmproxy

            self._tls = ssl.create_default_context(cafile=certifi.where())
            self._tls.set_alpn_protocols(["http/1.1"])
        return self._tls

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()


def _buffered(reader: asyncio.StreamReader) -> int:
    """Bytes an idle upstream connection has received and nobody read: it is out of step, never reused."""
    return len(getattr(reader, "_buffer", b""))


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


class Unserved(Exception):
    """The short path does not serve this request: mitmproxy gets the connection."""


@dataclass
class Head:
    method: bytes
    target: bytes
    fields: list[tuple[bytes, bytes]]  # without Content-Length, which the front writes itself
    length: int


def parse_head(head: bytes) -> Head:
    """A request head the short path serves (HTTP/1.1, CONNECT or a POST with a plain Content-Length body),
    or `Unserved`."""
    lines = head.split(b"\r\n")
    try:
        method, target, version = lines[0].split(b" ")
    except ValueError:
        raise Unserved("request line") from None
    if version != b"HTTP/1.1" or method not in (b"POST", b"CONNECT"):
        raise Unserved("not an HTTP/1.1 POST")
    fields = []
    length = None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name[-1:] in b" \t" or line[:1] in b" \t" or _BARE.search(line):
            raise Unserved("header line")
        lower = name.lower()
        if lower == b"content-length":
            if length is not None or not value.strip().isdigit():
                raise Unserved("content-length")
            length = int(value)
        elif lower in _UNSERVED_FIELDS:
            raise Unserved(lower.decode())
        else:
            fields.append((name, value.strip()))
    if method == b"CONNECT":
        return Head(method, target, fields, 0)
    if length is None:
        raise Unserved("no content-length")
    return Head(method, target, fields, length)


_HOP_FIELDS = frozenset((b"connection", b"keep-alive", b"te", b"trailer", b"proxy-connection"))
_BARE = re.compile(rb"[\r\n\0]")  # a bare CR or LF splits a request differently upstream: never served
_UNSERVED_FIELDS = frozenset((b"transfer-encoding", b"expect", b"upgrade", b"content-encoding"))


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
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.trailing = self.complete

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        if self._interim():
            return
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message is complete

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        if self._interim():  # 100 Continue, 103 Early Hints: the answer is still to come
            self.reason, self.fields = b"", []
            return
        self.complete = True

    def _interim(self) -> bool:
        return 100 <= self.parser.get_status_code() < 200 and not self.complete


# --- the server -----------------------------------------------------------------------------------


class Front:
    """Accepts the agents' connections; serves LLM calls, hands the rest to mitmproxy on `mitm_port`."""

    def __init__(self, calls: Calls, mitm_port: int, certs: LeafCerts) -> None:
        self.calls = calls
        self.mitm_port = mitm_port
        self.certs = certs
        self.pool = UpstreamPool()
        self.server: asyncio.Server | None = None
        self._peer_tls: ssl.SSLContext | None = None

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._connection, host, port, backlog=512, limit=MAX_HEAD)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.pool.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = Plain(reader, writer)
        try:
            await self._serve(client, None, b"")
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("lcap: front connection failed")
        finally:
            client.close()

    async def _serve(self, client: Plain, tunnel: Tunnel | None, buf: bytes) -> None:
        """Serve one call after another on the agent's connection, until it closes or leaves for mitmproxy."""
        while True:
            while (end := buf.find(b"\r\n\r\n")) < 0:
                if len(buf) > MAX_HEAD:
                    return await self._hand_off(client, buf, tunnel)
                data = await client.recv()
                if not data:
                    return
                buf += data
            raw_head, buf = buf[: end + 4], buf[end + 4 :]
            try:
                head = parse_head(raw_head[:-4])
                if head.method == b"CONNECT":
                    if tunnel is not None:
                        raise Unserved("CONNECT in a tunnel")
                    return await self._tunnel(client, head, raw_head, buf)
                target = _target(head, tunnel)
            except Unserved:
                return await self._hand_off(client, raw_head + buf, tunnel)
            episode, fields = take_episode(head.fields)
            dialect, scheme, host, port, path = target
            try:  # before the body: clients often write it separately, and this work is then done while it comes
                call = self.calls.open_call(
                    dialect,
                    episode or (tunnel.episode if tunnel else None),
                    scheme=scheme,
                    host=host,
                    port=port,
                    path=path,
                    fields=fields,
                )
                upstream_head, client_close = _request_head(call)
            except Exception:  # a capture bug: the call still goes through, by mitmproxy
                log.exception("lcap: capture error on %s (the call goes through mitmproxy)", path)
                return await self._hand_off(client, raw_head + buf, tunnel)
            if len(buf) < head.length:
                pieces, have = [buf], len(buf)
                while have < head.length:
                    data = await client.recv()
                    if not data:
                        return
                    pieces.append(data)
                    have += len(data)
                buf = b"".join(pieces)
            body, buf = buf[: head.length], buf[head.length :]
            try:
                is_call = self.calls.take_body(call, body)
            except Exception:
                log.exception("lcap: capture error on %s (the call goes through mitmproxy)", path)
                is_call = False
            if not is_call:  # a side call on an LLM path (or a capture bug)
                return await self._hand_off(client, raw_head + body + buf, tunnel)
            if not await self._call(client, call, upstream_head, client_close):
                return

    async def _call(self, client: Plain, call: Call, upstream_head: bytes, client_close: bool) -> bool:
        """Forward one call and answer the agent; False when the agent's connection is done."""
        key = (call.scheme, call.host, call.port)
        upstream = None
        try:
            upstream, parts = await self._send(key, b"%s%d\r\n\r\n%s" % (upstream_head, len(call.body), call.body))
            reuse = await self._answer(client, call, upstream, parts, client_close)
        except (OSError, ssl.SSLError, EOFError, httptools.HttpParserError) as exc:
            if upstream is not None:
                upstream.close()
            why = f"upstream {call.scheme}://{call.host}:{call.port}: {exc.__class__.__name__}: {exc}"
            self.calls.close_call(call.pending, why)
            if call.pending.chunks is not None:  # a stream: the agent may have part of it, cut it off
                return False
            body = f"lcap: {why}".encode()
            client.send(
                b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            return True
        except BaseException:
            if upstream is not None:
                upstream.close()
            self.calls.close_call(call.pending, "the call was interrupted")
            raise
        if reuse:
            self.pool.give_back(key, upstream)
        else:
            upstream.close()
        return reuse is not None and not client_close

    async def _send(self, key: tuple[str, str, int], message: bytes) -> tuple[Plain, _ResponseParts]:
        """Send the call upstream and read its response head. A reused connection the upstream closed without a
        byte of answer is replaced once, as HTTP clients do with idle connections (the upstream closed it idle)."""
        upstream = self.pool.take(key)
        may_retry = upstream is not None
        while True:
            upstream = upstream or await self.pool.open(key)
            try:
                return upstream, await _response_head(upstream, message)
            except _Stale:
                upstream.close()
                if not may_retry:
                    raise EOFError("the upstream closed the connection before answering") from None
                upstream, may_retry = None, False
            except BaseException:
                upstream.close()
                raise

    async def _answer(
        self, client: Plain, call: Call, upstream: Plain, parts: _ResponseParts, client_close: bool
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
        fields = b"".join(b"%s: %s\r\n" % f for f in keep)
        head = b"HTTP/1.1 %d %s\r\n%s" % (status, parts.reason, fields)
        transform = self.calls.answer_head(
            call.pending, status, content_type.decode("latin-1"), encoding.decode("latin-1") or None
        )
        if transform is not None:
            # framed answers go out chunked (the transform may change lengths); others end with the connection
            head += b"transfer-encoding: chunked\r\n\r\n" if framed else b"\r\n"
            if not await _stream(client, upstream, parts, head, transform, framed):
                self.calls.close_call(call.pending, "the agent closed the connection during the stream")
                return None
            if framed and not parts.complete:
                raise EOFError("the upstream closed the connection mid-stream")
            self.calls.close_call(call.pending)
        else:
            while not parts.complete:
                data = await upstream.recv()
                if not data:
                    if framed:
                        raise EOFError("the upstream closed the connection mid-response")
                    break
                parser.feed_data(data)
            body = b"".join(parts.body)
            body = self.calls.answer_body(call.pending, body) or body
            client.send(head + (b"\r\n" if no_body else b"content-length: %d\r\n\r\n" % len(body)) + body)
        try:
            await client.drain()
        except ConnectionError:
            return None
        return parts.keep_alive and not parts.trailing if framed else None

    # --- tunnels and hand-off ---------------------------------------------------------------------

    async def _tunnel(self, client: Plain, head: Head, raw_head: bytes, buf: bytes) -> None:
        """Accept a CONNECT; terminate TLS when the agent offers HTTP/1.1, else hand the tunnel on unopened."""
        host, _, port = head.target.decode("ascii", "replace").rpartition(":")
        if not host or not port.isdigit():
            return await self._hand_off(client, raw_head + buf, None)
        episode, _ = take_episode(head.fields)
        tunnel = Tunnel(host.strip("[]"), int(port), raw_head, episode)
        client.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
        data, hello = buf, None
        while True:
            try:
                hello = parse_client_hello(data) if data else None
            except ValueError:  # not TLS
                break
            if hello is not None or len(data) > MAX_HEAD:
                break
            chunk = await client.recv()
            if not chunk:
                return
            data += chunk
        if hello is None:
            tunnel.tls = False
            if data[:1].isalpha():  # plain HTTP inside the tunnel
                return await self._serve(client, tunnel, data)
            return await self._hand_off(client, data, tunnel)
        if hello.alpn_protocols and b"http/1.1" not in hello.alpn_protocols:
            tunnel.tls = False  # spliced unopened: mitmproxy negotiates HTTP/2 itself
            return await self._hand_off(client, data, tunnel)
        tunnel.sni = hello.sni or tunnel.host
        try:
            context = self.certs.context(tunnel.sni)
        except Exception as exc:  # a name lcap cannot make a certificate for: mitmproxy decides what to do
            log.warning("lcap: no certificate for %r (%s); the tunnel goes to mitmproxy", tunnel.sni, exc)
            tunnel.tls = False
            return await self._hand_off(client, data, tunnel)
        tls = TlsServerSide(client.reader, client.writer, context)
        await tls.handshake(data)
        await self._serve(tls, tunnel, b"")

    async def _hand_off(self, client: Plain, data: bytes, tunnel: Tunnel | None) -> None:
        """Give the connection to mitmproxy: replay the CONNECT (and TLS) it came through, then what was read."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.mitm_port, limit=MAX_HEAD)
        mitm = Plain(reader, writer)
        try:
            if tunnel is not None:
                writer.write(tunnel.connect_head)
                answer = await reader.readuntil(b"\r\n\r\n")
                if b" 200 " not in answer.split(b"\r\n", 1)[0] + b" ":
                    raise ConnectionError(f"mitmproxy refused the tunnel: {answer[:80]!r}")
                if tunnel.tls:
                    await writer.start_tls(self._peer_context(), server_hostname=tunnel.sni)
            if data:
                mitm.send(data)
            await _splice(client, mitm)
        finally:
            mitm.close()

    def _peer_context(self) -> ssl.SSLContext:
        """TLS from the front to mitmproxy over loopback: mitmproxy's certificate is lcap's own."""
        if self._peer_tls is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            ctx.set_alpn_protocols(["http/1.1"])
            self._peer_tls = ctx
        return self._peer_tls


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


def _target(head: Head, tunnel: Tunnel | None) -> tuple[str, str, str, int, str]:
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


async def _response_head(upstream: Plain, message: bytes) -> _ResponseParts:
    upstream.send(message)
    parts = _ResponseParts()
    parser = parts.parser
    got = False
    while not parts.head_done:
        try:
            data = await upstream.recv()
        except ConnectionResetError:
            data = b""
        if not data:
            if got:
                raise EOFError("the upstream closed the connection mid-head")
            raise _Stale
        got = True
        parser.feed_data(data)
    return parts


async def _stream(
    client: Plain,
    upstream: Plain,
    parts: _ResponseParts,
    head: bytes,
    transform: Callable[[bytes], bytes | list[bytes]],
    chunked: bool,
) -> bool:
    """Pass the body on as it comes, never buffered: one write per upstream read. The head waits up to
    `HEAD_HOLD` seconds for the first piece of body to send (an event whole, on the vLLM path) and goes out
    with it: upstreams often write the two back to back, and one write is one TLS record for the agent to
    open instead of two. False when the agent went away."""
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
                    await client.drain()
                except ConnectionError:
                    return False
                if client.writer.is_closing():
                    return False
            data = await upstream.recv()
            if not data:
                break
            parts.parser.feed_data(data)
    finally:
        if hold is not None:
            hold.cancel()
    _frame(out, transform(b""), chunked)
    if chunked and parts.complete:
        out.append(b"0\r\n\r\n")
    client.send(b"".join(out))
    return True


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
