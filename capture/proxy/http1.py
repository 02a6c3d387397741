"""HTTP/1 request heads as the front reads them: framed, parsed by llhttp (httptools), or refused.

The front finds where a head ends (the first empty line, CRLF or bare LF, so that a head written
with bare LFs is answered instead of waited for), then hands exactly those bytes to llhttp in its
strict mode. llhttp refuses everything two HTTP implementations could read differently: a
duplicate, signed, listed or overflowing Content-Length, Content-Length together with
Transfer-Encoding (either order), a bare CR or LF or a NUL in a line, obs-fold, a space before a
colon. Any such error is a 400 and the connection closes; mitmproxy, or an upstream, never sees a
head that llhttp did not accept. What the short path does not serve is said by `RequestHead.unserved`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus

import httptools

HEAD_END = re.compile(rb"\n\r?\n")  # the empty line ending a head; a bare-LF one is found too, then refused


_LINE_START = re.compile(rb"(?:\r?\n)*[!#$%&'*+.^_`|~0-9A-Za-z-]{0,32}(?: |\Z)")  # empty lines, then a method


def not_a_head(start: bytes) -> bool:
    """True when `start`, the first bytes of a request, cannot begin a request line (a TLS handshake sent to the
    plain port, binary garbage): answered at once, not waited for until the head timeout."""
    return _LINE_START.match(start) is None


class BadRequest(Exception):
    """A head llhttp refuses: 400."""


@dataclass(slots=True)
class RequestHead:
    method: bytes
    target: bytes
    version: str
    fields: list[tuple[bytes, bytes]]  # without Content-Length, which the front writes itself
    length: int | None
    upgrade: bool  # an Upgrade field, or llhttp saw a protocol switch
    expect: bool

    def unserved(self) -> str | None:
        """Why the short path does not serve this request (mitmproxy does), or None."""
        if self.version != "1.1":
            return f"HTTP/{self.version}"
        if self.method != b"POST":
            return "not a POST"
        if self.upgrade:
            return "upgrade"
        if self.expect:  # the agent waits for a 100 Continue before its body: mitmproxy sends it
            return "expect"
        if self.length is None:  # a chunked body (Transfer-Encoding beside a Content-Length is a 400)
            return "no content-length"
        return None


class _Callbacks:
    __slots__ = ("complete", "fields", "url")

    def __init__(self) -> None:
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        self.complete = True


_HIGH = bytes(range(0x80, 0x100))
_HIGH_AS_X = bytes.maketrans(_HIGH, b"x" * len(_HIGH))


def parse_request_head(raw: bytes) -> RequestHead:
    """The head `raw` (up to and including its empty line), or `BadRequest`.

    A byte past ASCII in the request target (a raw 0xFF, unencoded UTF-8) cannot change where anything ends,
    but llhttp refuses it: llhttp reads the line with such bytes as `x`, and the target keeps its own bytes
    (the agent's call goes on as it was sent, and is stored)."""
    line_end = raw.find(b"\n")
    line = raw[:line_end]
    high = not line.isascii()
    cb = _Callbacks()
    parser = httptools.HttpRequestParser(cb)
    switched = False
    try:
        parser.feed_data(line.translate(_HIGH_AS_X) + raw[line_end:] if high else raw)
    except httptools.HttpParserUpgrade:  # CONNECT, or `Connection: upgrade`: llhttp stops at the head
        switched = True
    except httptools.HttpParserError as exc:
        raise BadRequest(str(exc) or exc.__class__.__name__) from None
    if not cb.complete:
        raise BadRequest("not an HTTP/1 request head")
    version = parser.get_http_version()
    if version not in ("1.0", "1.1"):
        raise BadRequest(f"HTTP/{version}")
    fields = []
    length = None
    upgrade, expect = switched, False
    for field in cb.fields:
        name = field[0].lower()
        if name == b"content-length":
            length = int(field[1])  # llhttp checked it: digits, one field, no Transfer-Encoding beside it
            continue
        if name == b"upgrade":
            upgrade = True
        elif name == b"expect":
            expect = True
        fields.append(field)
    method = parser.get_method()
    target = line[len(method) + 1 : len(method) + 1 + len(cb.url)] if high else cb.url
    return RequestHead(method, target, version, fields, length, upgrade, expect)


class Refused(Exception):
    """The front answers the agent itself with `status` and closes the connection."""

    def __init__(self, status: int, message: str, fields: bytes = b"") -> None:
        super().__init__(message)
        self.status, self.message, self.fields = status, message, fields


def refusal(status: int, message: str, fields: bytes = b"", *, close: bool = True) -> bytes:
    """A whole answer of lcap's own: `status`, and `message` as its plain-text body."""
    body = f"lcap: {message}\n".encode("utf-8", "replace")
    return b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n%s%s\r\n%s" % (
        status,
        HTTPStatus(status).phrase.encode(),
        len(body),
        fields,
        b"connection: close\r\n" if close else b"",
        body,
    )


PROXY_AUTHENTICATE = b'proxy-authenticate: Basic realm="lcap"\r\n'
