"""The fuzz suite's machinery (tests/integration/test_capture_fuzz.py): a scripted upstream, a canary, a raw-socket agent.

- `ScriptedUpstream` is a real HTTP/1.1 server on 127.0.0.1 (a thread per connection, httptools'
  request parser, keep-alive). Each call names its case in an `x-fuzz-case` header; the server
  answers it as the case's `Answer` says, byte for byte (broken SSE, broken gzip, a reset, a hang,
  ...), and records what it received and what it sent, so a test can compare the agent's answer
  with the upstream's and count the calls that reached it. A call id is answered once: a second answer
  under one id would replace the record of the first, which the agent may be reading (see `answered_again`).
- `Canary` stands where the agent meant to go (the original host). With `--upstream` set, an LLM
  call must never reach it (issue #14, requirement 6); it records every connection.
- `exchange` is the agent: it writes a request as raw bytes (plain HTTP, or HTTPS through CONNECT and
  lcap's CA; Content-Length or chunked), reads the answer with httptools under a deadline and says
  what came back: the upstream's answer, the proxy's own, a close, or nothing (a hang).
"""

from __future__ import annotations

import base64
import json
import re
import socket
import ssl
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import httptools
from fixtures_capture import SocketServer

CASE_HEADER = b"x-fuzz-case"
UPSTREAM_MARK = b"x-fuzz-upstream"  # on every answer the upstream writes: the agent can tell it from the proxy's
CANARY_MARK = b"x-fuzz-canary"

_LLM_PATH = re.compile(rb"/(chat/completions|completions|responses|messages)$")
_DIALECT_KEYS = {b"chat/completions": ("messages",), b"completions": ("prompt",), b"messages": ("messages",)}


def llm_path(path: bytes) -> bool:
    """An LLM API path, as the issue means it (query string ignored, trailing slashes too), on any host."""
    return bool(_LLM_PATH.search(path.split(b"?", 1)[0].rstrip(b"/")))


def call_shaped(path: bytes, body: bytes) -> bool:
    """A request body that is an LLM call to this path, read as leniently as can be: bad UTF-8 replaced, control
    characters, NaN and any size of number allowed. A deeper nesting than Python's parser takes counts when the
    object starts with the dialect's key (the corpus writes its deep bodies so)."""
    match = _LLM_PATH.search(path.split(b"?", 1)[0].rstrip(b"/"))
    if match is None:
        return False
    keys = _DIALECT_KEYS.get(match.group(1), ("input", "previous_response_id"))
    text = body.decode("utf-8", "replace").lstrip("\ufeff")
    try:
        value = json.loads(text, strict=False, parse_int=lambda s: 0, parse_float=lambda s: 0.0)
    except RecursionError:
        return any(re.match(rf'\s*\{{\s*"model"\s*:\s*"[^"]*"\s*,\s*"{key}"', text) for key in keys)
    except ValueError:
        return False
    return isinstance(value, dict) and any(key in value for key in keys)


# --- the upstream ---------------------------------------------------------------------------------


@dataclass
class Answer:
    """What the upstream does with one call. `pieces` are written one `sendall` each, `pause` seconds apart, so
    that the proxy reads them in separate pieces. `special`: "hang" (never answer), "reset" (RST after reading
    the request), "close" (close without a byte), "garbage" (a non-HTTP answer), "head-only" (a head announcing a
    body, then close)."""

    status: int = 200
    reason: bytes = b"OK"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)
    framing: str = "length"  # length | chunked | close
    cut: bool = False  # close before the end: fewer bytes than announced, or no last chunk
    pause: float = 0.0
    interim: bytes = b""  # 1xx answers written before the answer proper
    special: str | None = None
    after: bytes = b""  # written on the connection `after_delay` seconds after the answer, which stays open
    after_delay: float = 0.0

    @property
    def well_formed(self) -> bool:
        """An answer with valid HTTP framing that ends: the agent must get it as sent, whatever its content."""
        return self.special is None and not self.cut


@dataclass
class Received:
    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class Sent:
    status: int
    body: bytes  # the payload written so far (before chunk framing)
    complete: bool


class _RequestParts:
    """httptools callbacks: the requests of one connection, as they complete."""

    def __init__(self) -> None:
        self.done: list[tuple[Received, bool]] = []  # each request, and whether the connection stays open after it
        self.parser = httptools.HttpRequestParser(self)
        self._reset()

    def _reset(self) -> None:
        self.method = self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def feed(self, data: bytes) -> None:
        """Parse `data`; a request that asks for an upgrade (and gets none: the answer is not 101) leaves the parser
        at its end, so a new one reads what follows."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self.parser = httptools.HttpRequestParser(self)
            if rest := data[upgrade.args[0] :]:
                self.feed(rest)

    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.method = self.parser.get_method()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        received = Received(self.method, self.url, self.headers, b"".join(self.body))
        self.done.append((received, self.parser.should_keep_alive()))


class ScriptedUpstream:
    """The LLM server behind the proxy; see the module's docstring. `answers[case]` scripts a case's answer (a
    normal chat completion naming the case when unscripted); `release` ends every hung answer."""

    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {}
        self.received: defaultdict[str, list[Received]] = defaultdict(list)
        self.sent: dict[str, Sent] = {}  # the first answer written under each call id
        self.answered_again: list[str] = []  # call ids answered more than once: the corpus or the proxy is wrong
        self.parse_errors: list[str] = []  # requests from the proxy that are not HTTP/1.1 as httptools reads it
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self._conns: set[socket.socket] = set()
        self.server = SocketServer(self._take, backlog=1024)
        self.port, self.url = self.server.port, self.server.url

    def close(self) -> None:
        self._closing = True
        self.release.set()
        self.server.close()
        with self._lock:
            for conn in list(self._conns):
                _close_quietly(conn)

    def _take(self, conn: socket.socket) -> None:
        if self._closing:
            _close_quietly(conn)
            return
        with self._lock:
            self._conns.add(conn)
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        parts = _RequestParts()
        last = "no request"
        try:
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    return
                try:
                    parts.feed(data)
                except httptools.HttpParserError as exc:
                    with self._lock:
                        self.parse_errors.append(f"{exc} (after {last} on that connection): {data[:120]!r}")
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    return
                while parts.done:
                    request, keep_alive = parts.done.pop(0)
                    last = next((v.decode("latin-1") for k, v in request.headers if k.lower() == CASE_HEADER), "?")
                    if not self._answer(conn, request) or not keep_alive:
                        return
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            _close_quietly(conn)

    def _answer(self, conn: socket.socket, request: Received) -> bool:
        """Answer one request; False when the connection is done."""
        case = next((v.decode("latin-1") for k, v in request.headers if k.lower() == CASE_HEADER), "")
        if request.method == b"GET":  # the proxy's probe of the upstream at start (/v1/models)
            body = b'{"object":"list","data":[{"id":"fake-model","object":"model","owned_by":"fuzz"}]}'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            return True
        with self._lock:
            self.received[case].append(request)
            answer = self.answers.get(case) or chat_answer(case)
        if answer.special == "hang":
            self.release.wait(120)
            return False
        if answer.special == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if answer.special == "close":
            return False
        if answer.special == "garbage":
            conn.sendall(b"\x00\xffNOT HTTP AT ALL\r\n\r\n")
            return False
        if answer.interim:
            conn.sendall(answer.interim)
        body = b"".join(answer.pieces)
        head = [b"HTTP/1.1 %d %s\r\n" % (answer.status, answer.reason), b"%s: %s\r\n" % (UPSTREAM_MARK, case.encode())]
        head += [b"%s: %s\r\n" % field for field in answer.headers]
        if answer.framing == "length":
            head.append(b"content-length: %d\r\n" % len(body))
        elif answer.framing == "chunked":
            head.append(b"transfer-encoding: chunked\r\n")
        else:
            head.append(b"connection: close\r\n")
        sent = Sent(answer.status, b"", False)
        with self._lock:
            if case in self.sent:
                self.answered_again.append(case)
            else:
                self.sent[case] = sent
        conn.sendall(b"".join(head) + b"\r\n")
        if answer.special == "head-only":
            return False
        pieces = answer.pieces[: max(1, len(answer.pieces) // 2)] if answer.cut else answer.pieces
        pieces = [piece for piece in pieces if piece]
        tail = b"" if answer.cut else (b"0\r\n\r\n" if answer.framing == "chunked" else b"")
        tail += b"" if answer.cut or answer.after_delay else answer.after  # the end and what follows: one write
        for i, piece in enumerate(pieces):
            if answer.pause:
                time.sleep(answer.pause)
            framed = b"%x\r\n%s\r\n" % (len(piece), piece) if answer.framing == "chunked" else piece
            conn.sendall(framed + (tail if i == len(pieces) - 1 else b""))
            sent.body += piece
        if not pieces and tail:
            conn.sendall(tail)
        if answer.cut:
            return False
        sent.complete = True
        if answer.after_delay:
            time.sleep(answer.after_delay)
            conn.sendall(answer.after)
        return answer.framing != "close"


def chat_answer(case: str, **kwargs) -> Answer:
    """A normal chat completion whose text names the case."""
    body = json.dumps(
        {
            "id": "chatcmpl-fuzz",
            "object": "chat.completion",
            "model": "fake-model",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": answer_text(case)}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
    ).encode()
    return Answer(headers=[(b"content-type", b"application/json")], pieces=[body], **kwargs)


def answer_text(case: str) -> str:
    return f"answer to {case}"


class Canary:
    """The host the agent called. Records every connection it gets as (case, method, target): the case from the
    `x-fuzz-case` field of a plain request, or from the TLS server name (`CASE.fuzz.test`) of a tunnel, whose
    request it cannot read (the proxy does not trust it). Answers plain HTTP with 200 and its mark."""

    def __init__(self) -> None:
        self.hits: list[tuple[str, bytes | None, bytes | None]] = []
        self._lock = threading.Lock()
        self.server = SocketServer(self._serve, threaded=True, backlog=1024)
        self.port = self.server.port

    def close(self) -> None:
        self.server.close()

    def _serve(self, conn: socket.socket) -> None:
        from mitmproxy.proxy.layers.tls import parse_client_hello

        with conn:
            conn.settimeout(5)
            data = b""
            hit: tuple[str, bytes | None, bytes | None] | None = None
            try:
                while hit is None and len(data) < 1 << 20:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                    if data[:1] == b"\x16":
                        hello = parse_client_hello(data)
                        if hello is not None:
                            hit = ((hello.sni or "").split(".fuzz.test")[0], None, None)
                    elif b"\r\n\r\n" in data:
                        line, _, rest = data.partition(b"\r\n")
                        case = re.search(rb"(?im)^x-fuzz-case: *([^\r\n]*)", rest)
                        method, _, target = line.partition(b" ")
                        target = re.sub(rb"^https?://[^/]*", b"", target.rpartition(b" ")[0])
                        hit = ((case.group(1) if case else b"").decode("latin-1"), method, target)
            except (OSError, ValueError):
                pass
            with self._lock:
                self.hits.append(hit or ("", None, data[:40]))
            if hit is not None and hit[1] is not None:
                body = b'{"canary": true}'
                try:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\n%s: 1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                        b"connection: close\r\n\r\n%s" % (CANARY_MARK, len(body), body)
                    )
                except OSError:
                    pass


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


# --- the agent ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the agent got back."""

    status: int | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False
    error: str | None = None  # "timeout" (a hang), "closed", a socket or TLS error, "bad answer: ..."
    seconds: float = 0.0

    @property
    def from_upstream(self) -> bool:
        return UPSTREAM_MARK in self.headers

    @property
    def from_canary(self) -> bool:
        return CANARY_MARK in self.headers

    @property
    def from_proxy(self) -> bool:
        return self.status is not None and not self.from_upstream and not self.from_canary

    def brief(self) -> str:
        """The answer in a line: the proxy's own with its text, another's with its size and, for the upstream's,
        the call id it answered."""
        who = "canary" if self.from_canary else "proxy"
        if self.from_upstream:
            who = f"upstream (call {self.headers[UPSTREAM_MARK].decode('latin-1')})"
        got = f"{self.status} from the {who}" if self.status is not None else "no answer"
        body = repr(self.body[:120]) if self.from_proxy else f"{len(self.body)} bytes of body"
        return f"{got}{'' if self.complete else ' (incomplete)'}{f', {self.error}' if self.error else ''} {body}"


class _ResponseParts:
    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.head_done = self.complete = False
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self.headers = {}
            return
        self.status, self.head_done = status, True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True


@dataclass
class Agent:
    """How to reach the proxy and its destinations: `proxy_url(episode)` gives an episode's proxy URL (its
    credentials become Proxy-Authorization), `bundle` is the CA file agents trust."""

    port: int
    proxy_url: Callable[[str], str]
    bundle: str
    canary_port: int

    def auth(self, episode: str) -> bytes:
        url = urlsplit(self.proxy_url(episode))
        pair = f"{unquote(url.username or '')}:{unquote(url.password or '')}".encode()
        return b"Basic " + base64.b64encode(pair)

    def tls_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.bundle)


@dataclass
class Request:
    """One agent request. `raw(target, auth)` builds the whole request (framing fuzz); otherwise the request is
    made of `path`, `headers` and `body`, with Content-Length (or `length` when set) or chunked framing."""

    path: bytes = b"/v1/chat/completions"
    body: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    length: bytes | None = None
    raw: Callable[[bytes, bytes], bytes] | None = None
    half_close: bool = False  # shut the agent's sending side after the request (plain HTTP only)
    expect_wait: bool = False  # send the head, wait for 100 Continue (or an answer), then the body
    linger: Callable[[], object] | None = None  # called once the answer is read, before the agent closes


def exchange(agent: Agent, transport: str, case: str, episode: str, request: Request, timeout: float) -> Outcome:
    """Send `request` through the proxy as `episode` on `transport` (http, https, http-chunked, https-chunked) and
    read the answer within `timeout` seconds. HTTPS goes to the server name `CASE.fuzz.test`, which the canary
    can read when a tunnel reaches it."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    out = Outcome()
    sock: socket.socket | None = None
    try:
        sock = socket.create_connection(("127.0.0.1", agent.port), timeout=timeout)
        tls = transport.startswith("https")
        target_host = b"127.0.0.1:%d" % agent.canary_port
        if tls:
            sock.sendall(
                b"CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: %s\r\n\r\n"
                % (target_host, target_host, agent.auth(episode))
            )
            head = b""
            while b"\r\n\r\n" not in head:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = sock.recv(65536)
                if not data:
                    out.error = "the proxy closed the tunnel"
                    return out
                head += data
            if not head.startswith(b"HTTP/1.1 200"):
                out.status, out.error = int(head[9:12] or 0), f"CONNECT refused: {head[:60]!r}"
                return out
            sock = agent.tls_context().wrap_socket(sock, server_hostname=f"{case}.fuzz.test")
        prefix = b"" if tls else b"http://%s" % target_host
        auth = b"" if tls else agent.auth(episode)
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = _request_bytes(request, prefix, auth, case, chunked=transport.endswith("chunked"))
        early = b""
        if request.expect_wait:
            head, _, body = data.partition(b"\r\n\r\n")
            sock.sendall(head + b"\r\n\r\n")
            early = _await_continue(sock, deadline)
            data = b"" if early else body  # an answer before the 100: the body is not wanted
        sock.sendall(data)
        if request.half_close and not tls:
            sock.shutdown(socket.SHUT_WR)
        _read_answer(sock, deadline, out, early)
        if request.linger is not None:
            request.linger()
    except TimeoutError:
        out.error = "timeout"
    except (OSError, ssl.SSLError) as exc:
        out.error = out.error or f"{exc.__class__.__name__}: {exc}"
    finally:
        if sock is not None:
            _close_quietly(sock)
        out.seconds = time.monotonic() - t0
    return out


def _request_bytes(request: Request, prefix: bytes, auth: bytes, case: str, *, chunked: bool) -> bytes:
    fixed = [(CASE_HEADER, case.encode())]
    if auth:
        fixed.append((b"Proxy-Authorization", auth))
    if request.raw is not None:
        lines = b"".join(b"%s: %s\r\n" % f for f in fixed)
        return request.raw(prefix, lines)
    fields = [(b"Host", b"api.openai.com"), *fixed, (b"Content-Type", b"application/json"), *request.headers]
    body = request.body
    if chunked:
        fields.append((b"Transfer-Encoding", b"chunked"))
        body = _chunked(body)
    else:
        fields.append((b"Content-Length", request.length if request.length is not None else b"%d" % len(body)))
    head = b"POST %s%s HTTP/1.1\r\n%s\r\n" % (prefix, request.path, b"".join(b"%s: %s\r\n" % f for f in fields))
    return head + body


def _chunked(body: bytes) -> bytes:
    """The body in chunks of uneven sizes (a function of its length, so a case is the same every run)."""
    out, pos, size = [], 0, 1 + len(body) % 7
    while pos < len(body):
        out.append(b"%x\r\n%s\r\n" % (len(body[pos : pos + size]), body[pos : pos + size]))
        pos, size = pos + size, size * 3 + 1
    return b"".join(out) + b"0\r\n\r\n"


def _await_continue(sock: socket.socket, deadline: float) -> bytes:
    """Wait for the proxy's 100 Continue; b"" once it came, else the start of the answer that came instead."""
    data = b""
    while b"\r\n\r\n" not in data:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            return data or b"\0"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    if head.startswith(b"HTTP/1.1 100"):
        return rest
    return data


def _read_answer(sock: socket.socket, deadline: float, out: Outcome, early: bytes = b"") -> None:
    parts = _ResponseParts()
    try:
        if early.strip(b"\0"):
            parts.parser.feed_data(early)
        while not parts.complete:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = sock.recv(1 << 20)
            except ConnectionResetError as exc:
                out.error = f"reset: {exc}"
                break
            except ssl.SSLError as exc:
                out.error = f"TLS: {exc}"
                break
            if not data:
                if (
                    parts.head_done
                    and "content-length" not in _lower(parts.headers)
                    and b"chunked" not in parts.headers.get(b"transfer-encoding", b"")
                ):
                    parts.complete = True  # the body ends with the connection
                elif not parts.head_done:
                    out.error = "closed"
                break
            try:
                parts.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                break
            except httptools.HttpParserError as exc:
                out.error = f"bad answer: {exc}"
                break
    finally:
        out.status, out.headers, out.body, out.complete = (
            parts.status,
            parts.headers,
            b"".join(parts.body),
            parts.complete,
        )


def _lower(headers: dict[bytes, bytes]) -> set[str]:
    return {name.decode("latin-1") for name in headers}
