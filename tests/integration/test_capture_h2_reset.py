"""HTTP/2 rapid reset (CVE-2023-44487, issue #48 row 10): an agent that opens and resets streams as fast as its
socket takes them cannot hold the other agents' calls.

A real proxy (in-process, its mitmproxy and front), a real HTTP/2 attacker (the `h2` library through CONNECT and
lcap's TLS, as agents reach it), a well-behaved HTTP/2 agent (the same client, one call per stream) and an HTTP/1.1 agent (httpx) beside it. What the defence
guarantees is asserted here: the flood's connection gets GOAWAY (ENHANCE_YOUR_CALM) once past
`--max-stream-resets`, cut within one parsed slice of the bound, logged and counted; every other call is answered;
a stream reset in the same read as its request costs no upstream call and no turn. How long the others wait is the
benchmark's (benchmarks/bench_h2_rapid_reset.py), never a test's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import httpx
from fixtures_capture import turns

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.mitm_guards import H2_SLICE_BYTES
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
BODY = json.dumps(CHAT).encode()
URL = "https://api.openai.com/v1/chat/completions"
HEADERS = [
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":scheme", "https"),
    (":authority", "api.openai.com"),
    ("content-type", "application/json"),
]
CAP = 100


class H2Client:
    """One HTTP/2 connection through the proxy's CONNECT tunnel and lcap's TLS, driven frame by frame."""

    def __init__(self, proxy: CaptureProxy) -> None:
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        sock.sendall(b"CONNECT api.openai.com:443 HTTP/1.1\r\nhost: api.openai.com:443\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        context = ssl.create_default_context(cafile=bundle(proxy))
        context.set_alpn_protocols(["h2"])
        self.tls = context.wrap_socket(sock, server_hostname="api.openai.com")
        assert self.tls.selected_alpn_protocol() == "h2"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.tls.sendall(self.conn.data_to_send())
        self.events: list[h2.events.Event] = []
        self.sent = 0  # bytes of the last `reset_streams` write

    def reset_streams(self, count: int, *, body: bool) -> int:
        """`count` streams opened and reset at once, all in one write (with `body`: each a whole request before its
        RST_STREAM); the bytes one stream took after the first (HPACK makes the first one longer)."""
        for _ in range(count):
            stream = self.conn.get_next_available_stream_id()
            self.conn.send_headers(stream, HEADERS, end_stream=not body)
            if body:
                self.conn.send_data(stream, BODY, end_stream=True)
            self.conn.reset_stream(stream)
            first = len(self.conn.data_to_send(0)) if stream == 1 else 0
        data = self.conn.data_to_send()
        self.sent = len(data)
        with contextlib.suppress(OSError):
            self.tls.sendall(data)
        return (len(data) - first) // max(1, count - 1)

    def call(self) -> tuple[int, bytes]:
        """One whole chat call on this connection: (status, answer body)."""
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [*HEADERS, ("content-length", str(len(BODY)))])
        self.conn.send_data(stream, BODY, end_stream=True)
        self.tls.sendall(self.conn.data_to_send())
        status, answer = 0, b""
        while not any(isinstance(e, h2.events.StreamEnded) and e.stream_id == stream for e in self.events):
            self.read()
        for event in self.events:
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream:
                status = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.DataReceived) and event.stream_id == stream:
                answer += event.data
        return status, answer

    def goaway(self) -> h2.events.ConnectionTerminated | None:
        """The GOAWAY the proxy sent before closing the connection; None if it closed without one."""
        with contextlib.suppress(OSError, h2.exceptions.ProtocolError):
            while not self.closed():
                self.read()
        return next((e for e in self.events if isinstance(e, h2.events.ConnectionTerminated)), None)

    def closed(self) -> bool:
        return any(isinstance(e, h2.events.ConnectionTerminated) for e in self.events)

    def read(self) -> None:
        data = self.tls.recv(65536)
        if not data:
            raise ConnectionError("the proxy closed the connection")
        self.events += self.conn.receive_data(data)
        if pending := self.conn.data_to_send():
            self.tls.sendall(pending)

    def close(self) -> None:
        self.tls.close()


def bundle(proxy: CaptureProxy) -> str:
    return proxy.child_env(None, base={})["SSL_CERT_FILE"]


def test_a_rapid_reset_flood_gets_goaway_and_every_other_call_is_answered(
    tmp_path, capture_home, monkeypatch, llm, caplog
):
    """2,000 streams opened and reset in one write: past `--max-stream-resets` the connection gets GOAWAY
    (ENHANCE_YOUR_CALM), having been parsed at most one slice past the bound (the GOAWAY's last stream id says how
    far); one log line and one count. Meanwhile an HTTP/1.1 agent's calls and an HTTP/2 agent's calls on their own
    connections are all answered, and no reset stream reached the upstream or the store."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    caplog.set_level(logging.WARNING, logger="lcap.capture")
    store = Store(tmp_path / "lcap.duckdb")
    options = ProxyOptions(upstream=llm.url, token_ids=False, require_credentials=False, max_stream_resets=CAP)
    answers: list[tuple[int, str]] = []
    with CaptureProxy(store, options) as proxy:
        verify = ssl.create_default_context(cafile=bundle(proxy))
        stop = threading.Event()

        def http1_agent() -> None:
            with httpx.Client(proxy=proxy.url, verify=verify, timeout=60) as client:
                while not stop.is_set() or not answers:
                    try:
                        answer = client.post(URL, json=CHAT)
                        answers.append((answer.status_code, answer.json()["choices"][0]["message"]["content"]))
                    except (httpx.HTTPError, ValueError, LookupError) as exc:  # a failed call fails the test below
                        answers.append((0, repr(exc)))

        http2_agent = H2Client(proxy)
        try:
            before = http2_agent.call()
            thread = threading.Thread(target=http1_agent)
            thread.start()
            attacker = H2Client(proxy)
            try:
                per_stream = attacker.reset_streams(2000, body=False)
                during = http2_agent.call()
                goaway = attacker.goaway()
            finally:
                attacker.close()
                stop.set()
                thread.join(60)
            after = http2_agent.call()
            assert not http2_agent.closed()
        finally:
            http2_agent.close()
        assert proxy.flush(timeout=30)
        floods = proxy.counters()["stream_reset_floods"]

    assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    parsed = goaway.last_stream_id // 2 + 1  # streams the proxy read before it stopped (client ids are odd)
    assert CAP < parsed <= CAP + 1 + H2_SLICE_BYTES // per_stream + 1
    assert floods == 1
    cut = [r.getMessage() for r in caplog.records if "--max-stream-resets" in r.getMessage()]
    assert len(cut) == 1 and f"over {CAP} HTTP/2 streams" in cut[0]
    for status, answer in (before, during, after):
        assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"] == llm.text
    assert answers and answers == [(200, llm.text)] * len(answers)
    calls = 3 + len(answers)  # the HTTP/2 agent's and the HTTP/1.1 agent's, none of the attacker's
    assert len(llm.calls("/chat/completions")) == calls
    assert len(turns(store.path)) == calls


def test_streams_reset_in_the_read_of_their_request_cost_no_upstream_call(tmp_path, capture_home, monkeypatch, llm):
    """Under the bound, whole requests each reset in the same write (HEADERS, DATA, RST_STREAM; one TLS record,
    within one parsed slice): none is sent upstream or stored (nobody waits for its answer), the connection stays
    open, and a call on it afterwards is answered and stored."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    store = Store(tmp_path / "lcap.duckdb")
    options = ProxyOptions(upstream=llm.url, token_ids=False, require_credentials=False, max_stream_resets=CAP)
    with CaptureProxy(store, options) as proxy:
        attacker = H2Client(proxy)
        try:
            attacker.reset_streams(20, body=True)
            assert attacker.sent <= H2_SLICE_BYTES
            status, answer = attacker.call()
            assert not attacker.closed()
        finally:
            attacker.close()
        assert proxy.flush(timeout=30)
        assert proxy.counters()["stream_reset_floods"] == 0
    assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"] == llm.text
    assert len(llm.calls("/chat/completions")) == 1
    assert [t["status_code"] for t in turns(store.path)] == [200]
