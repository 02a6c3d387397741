"""Every defence of the front's request reading, one case each, through a real proxy and real sockets.

The front frames each head itself, has llhttp (strict) parse it, and answers what it refuses (capture/proxy/http1.py,
capture/proxy/front.py). Each case here fails if its defence is removed: a head two HTTP implementations could read
differently gets a 400 and reaches no upstream; what the short path must not serve (Expect, Upgrade, HTTP/1.0, a
GET with a body, a chunked body) is served by mitmproxy, correctly; limits answer 408, 413, 431; pipelined calls
are answered in order; an upstream connection that is out of step is never reused.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
from fixtures_capture import raw_exchange, turns
from fixtures_ray import closed_port

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
BODY = json.dumps(CHAT).encode()
TEXT = b"Hello from the upstream."
LIMITS = ProxyOptions(
    require_credentials=False, max_body_bytes=1 << 20, head_timeout=1.0, body_timeout=1.0, idle_timeout=3.0
)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, capture_home):
    """One proxy for the module (anonymous: these cases are about HTTP, not attribution), with short timeouts."""
    old = os.environ.get("LCAP_HOME")
    os.environ["LCAP_HOME"] = str(capture_home)
    try:
        with CaptureProxy(Store(tmp_path_factory.mktemp("http1") / "lcap.duckdb"), LIMITS) as proxy:
            yield proxy
    finally:
        if old is None:
            os.environ.pop("LCAP_HOME", None)
        else:
            os.environ["LCAP_HOME"] = old


def exchange(proxy: CaptureProxy, data: bytes, *, wait: float = 5.0, then: bytes = b"") -> tuple[bytes, float]:
    """What the proxy answers `data` (see raw_exchange), and the seconds until the connection ended."""
    t0 = time.monotonic()
    got = raw_exchange(proxy.port, data, then=then, timeout=wait)
    return got, time.monotonic() - t0


def request(
    url: str, fields: bytes, body: bytes = BODY, *, line: bytes = b"POST %s/v1/chat/completions HTTP/1.1"
) -> bytes:
    """A request head written as given (`fields` are raw lines, each ending in CRLF unless the case says not)."""
    return (line % url.encode()) + b"\r\nhost: x\r\n" + fields + b"\r\n" + body


N = str(len(BODY)).encode()
REFUSED = {  # a head llhttp refuses: 400, and no upstream sees a byte of it
    "duplicate content-length": b"content-length: %s\r\ncontent-length: %s\r\n" % (N, N),
    "conflicting content-length": b"content-length: %s\r\ncontent-length: 0\r\n" % N,
    "listed content-length": b"content-length: %s, %s\r\n" % (N, N),
    "signed content-length": b"content-length: +%s\r\n" % N,
    "negative content-length": b"content-length: -1\r\n",
    "overflowing content-length": b"content-length: 99999999999999999999999\r\n",
    "content-length, then transfer-encoding": b"content-length: %s\r\ntransfer-encoding: chunked\r\n" % N,
    "transfer-encoding, then content-length": b"transfer-encoding: chunked\r\ncontent-length: %s\r\n" % N,
    "transfer-encoding not ending in chunked": b"transfer-encoding: gzip\r\ncontent-length: %s\r\n" % N,
    "bare LF inside a header line": b"x-a: 1\ncontent-length: 0\r\ncontent-length: %s\r\n" % N,
    "bare CR inside a header line": b"x-a: 1\rcontent-length: 0\r\ncontent-length: %s\r\n" % N,
    "NUL inside a header line": b"x-a: 1\x00\r\ncontent-length: %s\r\n" % N,
    "obs-fold": b"x-a: 1\r\n 2\r\ncontent-length: %s\r\n" % N,
    "space before the colon": b"content-length : %s\r\n" % N,
    "head ending in a bare LF": b"content-length: %s\n" % N,
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_head_two_parsers_could_read_differently_is_refused(proxy, llm, case):
    got, took = exchange(proxy, request(llm.url, REFUSED[case]))
    assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"lcap: bad request head" in got, got[:300]
    assert b"connection: close" in got and took < 4  # answered and closed at once: nothing waits for more
    assert llm.requests == []


def test_lcaps_own_answer_to_a_call_that_asked_to_close_closes_the_connection(proxy):
    """A call with `connection: close` that ends in lcap's own answer (a 502: nothing listens upstream) gets
    `connection: close` and the connection closed after it, as a relayed answer does (RFC 9112, 9.6): a client
    reading to the end of the connection is not left waiting for the idle timeout (3 s here)."""
    with closed_port() as port:
        fields = b"connection: close\r\ncontent-length: %s\r\n" % N
        got, took = exchange(proxy, request(f"http://127.0.0.1:{port}", fields))
    head = got.split(b"\r\n\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 502 Bad Gateway\r\n") and b"connection: close" in head, got[:300]
    assert took < 2


@pytest.mark.parametrize(
    "raw",
    [
        b"POST %s/v1/chat/completions HTTP/1.1\nhost: x\ncontent-length: 0\n\n",  # a head written with LFs only
        b"POST %s/v1/chat/completions\r\n\r\n",  # no version: HTTP/0.9
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n%s",  # an HTTP/2 preface on a proxy connection
    ],
    ids=["LF-only head", "HTTP/0.9", "HTTP/2 preface"],
)
def test_a_head_that_is_not_http_1_is_answered_never_waited_for(proxy, llm, raw):
    got, took = exchange(proxy, raw % llm.url.encode())
    assert got.startswith(b"HTTP/1.1 400") and took < 4
    assert llm.requests == []


def test_a_target_with_bytes_past_ascii_goes_through_as_sent(proxy, llm):
    """A raw 0xFF in a query cannot change where anything ends: the call goes on as the agent wrote it."""
    line = b"POST %s/v1/chat/completions?x=\xff HTTP/1.1"
    got, _ = exchange(proxy, request(llm.url, b"content-length: %s\r\nconnection: close\r\n" % N, line=line))
    assert got.startswith(b"HTTP/1.1 200 OK") and TEXT in got
    assert [r["path"] for r in llm.requests] == ["/v1/chat/completions?x=\xff"]  # the byte, read as latin-1


def test_limits_on_a_head(proxy, llm):
    """Over `max_head_bytes`: 431. Begun and not finished within `head_timeout`: 408. Nothing said at all on a
    kept-alive connection for `idle_timeout`: closed without a word; on a new one that proved no episode, after
    `head_timeout` already."""
    big = b"x-big: " + b"a" * (70 * 1024) + b"\r\n"
    got, _ = exchange(proxy, request(llm.url, big + b"content-length: %s\r\n" % N))
    assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large")
    got, took = exchange(proxy, b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\n" % llm.url.encode())
    assert got.startswith(b"HTTP/1.1 408 Request Timeout") and 0.9 < took < 3
    assert llm.requests == []
    got, took = exchange(proxy, b"", wait=10)
    assert got == b"" and 0.9 < took < 3
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(request(llm.url, b"content-length: %s\r\n" % N))
        got, t0 = b"", time.monotonic()
        while TEXT not in got:
            got += sock.recv(65536)
        assert sock.recv(100) == b"" and 2.9 < time.monotonic() - t0 < 5  # kept alive for `idle_timeout`


def test_limits_on_a_body(proxy, llm):
    """A Content-Length over `max_body_bytes` is a 413 at once, before any of the body is read, and the call is an
    error turn; a body that stops coming is a 408 after `body_timeout`."""
    head = request(llm.url, b"content-length: %d\r\n" % (5 << 30), b"")
    got, took = exchange(proxy, head + b"x" * 100_000)
    assert got.startswith(b"HTTP/1.1 413 ") and took < 3
    assert b"--max-body-bytes" in got
    got, took = exchange(proxy, request(llm.url, b"content-length: %s\r\n" % N, BODY[:10]))
    assert got.startswith(b"HTTP/1.1 408") and 0.9 < took < 3
    assert llm.requests == []
    assert proxy.flush(timeout=10)
    (row,) = [r for r in turns(proxy.store.path) if r["status_code"] == 413]
    assert row["path"] == "/v1/chat/completions" and "over the limit of 1048576" in row["error"]


def test_pipelined_calls_are_answered_in_order(proxy, llm):
    one = request(llm.url, b"content-length: %s\r\n" % N)
    other = json.dumps({**CHAT, "model": "second"}).encode()
    two = request(llm.url, b"content-length: %d\r\nconnection: close\r\n" % len(other), other)
    got, _ = exchange(proxy, one + two)
    assert got.count(b"HTTP/1.1 200 OK") == 2
    first, second = got.split(b"HTTP/1.1 200 OK")[1:]
    assert b'"model": "gpt-4o-mini"' in first and b'"model": "second"' in second
    assert [c["body"]["model"] for c in llm.calls()] == ["gpt-4o-mini", "second"]


def test_expect_100_continue_is_answered_before_the_body(proxy, llm):
    """A client that waits for `100 Continue` before it sends its body (as it may, indefinitely) gets one: the front
    cannot send it, so such a request goes to mitmproxy, which does."""
    head = request(llm.url, b"content-length: %s\r\nexpect: 100-continue\r\n" % N, b"")
    got, _ = exchange(proxy, head, wait=3, then=BODY)
    assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK") and TEXT in got


def test_http_1_0_gets_an_http_1_0_exchange(proxy, llm):
    """An HTTP/1.0 client reads its answer until the connection closes: it is served by mitmproxy, which closes it;
    the short path would keep the connection for another request the client will never send."""
    got, took = exchange(
        proxy, request(llm.url, b"content-length: %s\r\n" % N, line=b"POST %s/v1/chat/completions HTTP/1.0")
    )
    assert TEXT in got and took < 2.0


def test_a_get_with_a_body_on_an_llm_path_stays_a_get(proxy, llm):
    got, _ = exchange(
        proxy,
        request(
            llm.url, b"content-length: %s\r\nconnection: close\r\n" % N, line=b"GET %s/v1/chat/completions HTTP/1.1"
        ),
    )
    assert got.startswith(b"HTTP/1.1 404")  # the upstream's answer to a GET there
    assert [r["method"] for r in llm.requests] == ["GET"]


def test_an_upgrade_goes_to_mitmproxy_which_switches_protocols(proxy):
    """A call asking to switch protocols can get a 101 and then bytes of another protocol: the front, which takes
    any 1xx for an interim answer, would wait for a final answer that never comes."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                data = b""
                while not data.endswith(BODY):
                    data += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: lcap-test\r\nconnection: upgrade\r\n\r\n")
                conn.sendall(b"echo:" + conn.recv(100))

        threading.Thread(target=serve, daemon=True).start()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        head = request(url, b"content-length: %s\r\nconnection: upgrade\r\nupgrade: lcap-test\r\n" % N)
        got, _ = exchange(proxy, head, wait=3, then=b"ping")
    assert got.startswith(b"HTTP/1.1 101 Switching Protocols") and got.endswith(b"echo:ping")


@pytest.mark.parametrize("how", ["after, in the same write", "the start of one, in the same write", "later, idle"])
def test_an_upstream_connection_out_of_step_is_never_reused(proxy, how):
    """An upstream that sends bytes after its answer (another answer nobody asked for, or the start of one) has a
    connection out of step: reusing it would give the next call, maybe another agent's, those bytes, or what
    follows them, for an answer."""
    answer = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "genuine"}}]}).encode()
    genuine = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(answer),
        answer,
    )
    poison = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\npoisoned"
    started = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"  # its body comes with the next request
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def serve() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                threading.Thread(target=answer_each, args=(conn,), daemon=True).start()

        sent = threading.Event()  # the first answer's every byte is out

        def answer_each(conn: socket.socket) -> None:
            with conn:
                first = True
                while conn.recv(65536):
                    if how.startswith("later"):
                        conn.sendall(genuine)
                        time.sleep(0.1)
                        conn.sendall(poison)
                    elif how.startswith("after"):
                        conn.sendall(genuine + poison)
                    else:
                        conn.sendall(genuine + started if first else b"xxxxx" + poison)
                    first = False
                    sent.set()

        threading.Thread(target=serve, daemon=True).start()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        call = request(url, b"content-length: %s\r\nconnection: close\r\n" % N)
        first, _ = exchange(proxy, call)
        assert sent.wait(10)
        time.sleep(0.3)  # the proxy reads what came after the answer
        second, _ = exchange(proxy, call)
    assert b"genuine" in first and b"poisoned" not in first
    assert second.startswith(b"HTTP/1.1 200 OK") and b"genuine" in second and b"poisoned" not in second
