"""The front's short path and its hand-offs to mitmproxy (capture/proxy/front.py), in-process, real sockets.

The front serves HTTP/1.1 LLM calls itself and gives any other connection to the embedded
mitmproxy with the bytes read so far. These tests mix both on one connection, send what the
short path does not serve (Expect, a chunked body, an HTTP/2-only TLS offer), and break things on
either side of a call: the agent leaving mid-stream, the upstream dropping connections.
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from fixtures_capture import FakeLLM, turns

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
TEXT = "Hello from the upstream."
ANONYMOUS = ProxyOptions(require_credentials=False)  # raw-socket tests: calls without credentials, unattributed


def _one_connection(proxy: CaptureProxy, episode: str) -> httpx.Client:
    """A client on a single keep-alive connection through `proxy`, trusting lcap's CA."""
    bundle = proxy.child_env(episode, base={})["SSL_CERT_FILE"]
    return httpx.Client(
        proxy=proxy.proxy_url(episode),
        verify=ssl.create_default_context(cafile=bundle),
        limits=httpx.Limits(max_connections=1),
        timeout=30,
    )


def test_side_calls_hand_the_connection_over_and_later_calls_are_still_turns(store, llm):
    """One keep-alive connection: an LLM call (short path), a model list and a side call on an LLM path (the
    connection moves to mitmproxy), another LLM call (now through mitmproxy). Every answer is the upstream's."""
    with CaptureProxy(store) as proxy, _one_connection(proxy, "ep-mixed") as client:
        chat = f"{llm.url}/v1/chat/completions"
        first = client.post(chat, json=CHAT)
        models = client.get(f"{llm.url}/v1/models")
        side = client.post(chat, json=[{"event": "telemetry"}])
        second = client.post(chat, json={**CHAT, "stream": True})
        assert proxy.flush(timeout=10)
    assert first.json()["choices"][0]["message"]["content"] == TEXT
    assert models.json()["data"][0]["id"] == "fake-model"
    assert side.json() == {"ok": True}
    assert "[DONE]" in second.text
    rows = turns(store.path)
    assert [(r["episode_id"], r["seq"], r["stream"], r["completion_text"]) for r in rows] == [
        ("ep-mixed", 0, False, TEXT),
        ("ep-mixed", 1, True, TEXT),
    ]
    for call in llm.requests:
        assert not {"proxy-authorization", "x-lcap-episode"} & {k.lower() for k in call["headers"]}


def test_expect_and_chunked_request_bodies_are_captured_through_mitmproxy(store, llm, tmp_path):
    body = tmp_path / "body.json"
    body.write_text(json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}))
    with CaptureProxy(store) as proxy:
        for extra in (["-H", "Expect: 100-continue"], ["-H", "Transfer-Encoding: chunked"]):
            out = subprocess.run(
                [
                    "curl",
                    "-sS",
                    "--fail",
                    "--proxy",
                    proxy.proxy_url("ep-curl"),
                    *extra,
                    "-H",
                    "content-type: application/json",
                    "--data-binary",
                    f"@{body}",
                    f"{llm.url}/v1/chat/completions",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["choices"][0]["message"]["content"] == TEXT
        assert proxy.flush(timeout=10)
    rows = turns(store.path)
    assert [(r["seq"], r["completion_text"]) for r in rows] == [(0, TEXT), (1, TEXT)]
    assert all(len(r["request"]["messages"][0]["content"]) == 5000 for r in rows)


def test_an_http2_only_tunnel_goes_to_mitmproxy_unopened(store):
    """A client that offers only h2 in its ClientHello (gRPC, say) must get h2: the front cannot speak it, so it
    splices the tunnel to mitmproxy, which terminates TLS with lcap's CA and negotiates HTTP/2."""
    with CaptureProxy(store, ANONYMOUS) as proxy, _tunnel_to_openai(proxy, alpn=["h2"]) as tls:
        assert tls.selected_alpn_protocol() == "h2"
        issuer = dict(x[0] for x in tls.getpeercert()["issuer"])
        assert issuer["organizationName"] == "mitmproxy"  # lcap's CA, made by mitmproxy's CertStore


def test_the_fronts_tls_sends_nothing_after_the_handshake_until_asked(store):
    """TLS 1.3 servers usually send session tickets right after the handshake, while the client already writes
    its request. A client that reads in one thread while it writes in another (websockets' sync client) then
    may lose its request: a Responses WebSocket opening through lcap hung until the idle timeout, rarely, on a
    loaded machine. The front terminates TLS without tickets, so nothing crosses the client's first write."""
    with CaptureProxy(store, ANONYMOUS) as proxy, _tunnel_to_openai(proxy) as tls:
        assert tls.version() == "TLSv1.3" and tls.selected_alpn_protocol() in (None, "http/1.1")
        readable, _, _ = select.select([tls.fileno()], [], [], 1.0)
        assert not readable, "the front sent TLS records (session tickets) before the agent's first request"
        tls.sendall(b"GET /v1/models HTTP/1.1\r\nHost: api.openai.com\r\nConnection: close\r\n\r\n")
        assert tls.recv(4096).startswith(b"HTTP/1.1 ")


@contextmanager
def _tunnel_to_openai(proxy: CaptureProxy, alpn: list[str] | None = None) -> Iterator[ssl.SSLSocket]:
    """A raw CONNECT to api.openai.com:443 through `proxy`, then TLS in it (offering `alpn`), trusting lcap's CA."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        ctx = ssl.create_default_context(cafile=proxy.child_env(None, base={})["SSL_CERT_FILE"])
        if alpn:
            ctx.set_alpn_protocols(alpn)
        with ctx.wrap_socket(sock, server_hostname="api.openai.com") as tls:
            yield tls


def test_an_agent_that_leaves_mid_stream_leaves_an_error_turn(store, llm):
    llm.gate = threading.Event()
    llm.chunk_delay = 0.05  # the rest comes in several writes: the first after the agent left meets its reset
    try:
        with CaptureProxy(store) as proxy:
            with _one_connection(proxy, "ep-gone") as client:
                with client.stream("POST", f"{llm.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
                    assert b"data:" in next(resp.iter_raw())
            llm.gate.set()  # the rest of the stream now finds the agent gone
            assert proxy.flush(timeout=10)
    finally:
        llm.gate.set()
    (row,) = turns(store.path)
    assert row["episode_id"] == "ep-gone" and row["stream"]
    assert "agent closed the connection" in row["error"]


def test_an_agent_that_leaves_after_the_last_event_leaves_a_whole_turn(store, llm):
    """Codex CLI closes an SSE stream once it has the final event, before the stream's own end: the turn is whole,
    not an error (one that leaves before the final event is: the test above)."""
    llm.end_gate = threading.Event()
    try:
        with CaptureProxy(store) as proxy:
            with _one_connection(proxy, "ep-done") as client:
                with client.stream("POST", f"{llm.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
                    seen = b""
                    for data in resp.iter_raw():
                        seen += data
                        if b'"finish_reason": "stop"' in seen:
                            break
            llm.end_gate.set()
            assert proxy.flush(timeout=10)
    finally:
        llm.end_gate.set()
    (row,) = turns(store.path)
    assert row["episode_id"] == "ep-done" and row["stream"] and row["finish_reason"] == "stop"
    assert row["error"] is None and row["completion_text"] == llm.text


def test_upstream_dropping_connections(store):
    """Kept-alive upstream connections the upstream closed are replaced without the agent noticing; an upstream
    that is gone gets the agent a 502 and the turn an error."""
    upstream = FakeLLM()
    upstream.drop_idle = True
    upstream.thread.start()
    try:
        with (
            CaptureProxy(store, ProxyOptions(upstream=upstream.url)) as proxy,
            _one_connection(proxy, "ep-drop") as client,
        ):
            url = "https://api.openai.com/v1/chat/completions"
            answers = [client.post(url, json=CHAT) for _ in range(5)]
            assert [a.json()["choices"][0]["message"]["content"] for a in answers] == [TEXT] * 5
            upstream.shutdown()
            upstream.server_close()
            failed = client.post(url, json=CHAT)
            assert proxy.flush(timeout=10)
    finally:
        upstream.server_close()
    assert failed.status_code == 502 and f"upstream {upstream.url}" in failed.text
    rows = turns(store.path)
    assert [r["error"] is None for r in rows] == [True] * 5 + [False]
    assert "ConnectionRefusedError" in rows[-1]["error"] and rows[-1]["status_code"] is None


def test_interim_answers_are_not_the_answer_and_a_half_closed_agent_has_left(store):
    """An upstream's 103 Early Hints before its 200 is not the agent's answer. An agent that closes its side after
    sending the request (shutdown(SHUT_WR), indistinguishable from close() until something is written) has left,
    as nginx and mitmproxy take it: its call is cancelled, the turn says why, and the agent gets nothing. (Its
    upstream here never answers: the agent's close is what ends the call, not an answer that came first.)"""
    answer = json.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": TEXT}, "finish_reason": "stop"}],
        }
    ).encode()

    def serve(sock: socket.socket) -> None:
        conn, _ = sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
            time.sleep(0.2)  # the answer proper comes in a later read
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(answer), answer)
            )

    with socket.socket() as early, socket.socket() as silent:
        early.bind(("127.0.0.1", 0))
        early.listen()
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # never accepts: connections wait in its backlog, unanswered
        threading.Thread(target=serve, args=(early,), daemon=True).start()
        port = early.getsockname()[1]
        with CaptureProxy(store, ANONYMOUS) as proxy, _one_connection(proxy, "ep-early") as client:
            got = client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT)
            assert got.status_code == 200 and got.json()["choices"][0]["message"]["content"] == TEXT
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
                body = json.dumps({**CHAT, "stream": True}).encode()
                agent.sendall(
                    b"POST http://127.0.0.1:%d/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (silent.getsockname()[1], len(body), body)
                )
                agent.shutdown(socket.SHUT_WR)
                received = b""
                while data := agent.recv(65536):
                    received += data
            assert received == b""
            assert proxy.flush(timeout=10)
    rows = turns(store.path)
    assert [(r["status_code"], r["completion_text"], r["error"]) for r in rows] == [
        (200, TEXT, None),
        (None, None, "the agent closed the connection before the answer"),
    ]


def test_a_header_line_with_a_bare_lf_is_refused(store, llm):
    """`X: a\\nContent-Length: 0` reads as two fields to some servers: forwarding it would split the request upstream
    and hand the next caller on that upstream connection someone else's answer. It gets a 400, and nothing else
    (tests/test_capture_http1.py has every such case)."""
    body = json.dumps(CHAT).encode()
    with CaptureProxy(store, ANONYMOUS) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sneaky:
            sneaky.sendall(
                b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-foo: a\ncontent-length: 0\r\n"
                b"content-length: %d\r\n\r\n%s" % (llm.url.encode(), len(body), body)
            )
            assert sneaky.recv(65536).startswith(b"HTTP/1.1 400")
        with _one_connection(proxy, "ep-next") as client:
            got = client.post(f"{llm.url}/v1/chat/completions", json=CHAT)
    assert got.status_code == 200 and got.json()["choices"][0]["message"]["content"] == TEXT
    assert len(llm.calls()) == 1


def _sse_upstream(gap: float) -> tuple[socket.socket, threading.Thread]:
    """An upstream that writes a stream's head, waits `gap` seconds, then writes its events: the first one in
    two halves, 10 ms apart. It answers a model list (vLLM's) first when asked."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    first = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'

    def serve() -> None:
        while True:
            conn, _ = sock.accept()
            with conn:
                if conn.recv(65536).startswith(b"GET"):
                    models = b'{"object":"list","data":[{"id":"m","owned_by":"vllm"}]}'
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                        b"connection: close\r\n\r\n%s" % (len(models), models)
                    )
                    continue
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                time.sleep(gap)
                for piece in (first[:20], first[20:], b"data: [DONE]\n\n"):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                    time.sleep(0.01)
                conn.sendall(b"0\r\n\r\n")
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, thread


# asyncio runs a timer as soon as it is within its clock resolution of due: a hold can end that much early
CLOCK = 0.01


@pytest.mark.parametrize(
    "gap, hold, token_ids, first_write",
    [
        (0.05, 1.0, False, b'data: {"choices":[{"'),  # the head goes out with the first piece of body
        (0.05, 1.0, True, b'"content":"ok"}}]}\n\n'),  # vLLM path: with the first whole event, rewritten
        (2.0, 0.2, False, None),  # the first event is slow: the head goes alone once the hold is over
    ],
)
def test_a_stream_head_waits_briefly_for_its_first_event(store, monkeypatch, gap, hold, token_ids, first_write):
    """The head of a streamed answer goes out in one write with the first body to send when that comes within
    `HEAD_HOLD` (one TLS record for the agent instead of two), and alone once `HEAD_HOLD` has passed: the head
    is never held until a slow first event."""
    from lcap.capture.proxy import exchange

    monkeypatch.setattr(exchange, "HEAD_HOLD", hold)
    upstream, thread = _sse_upstream(gap)
    url = f"http://127.0.0.1:{upstream.getsockname()[1]}"
    body = json.dumps({**CHAT, "stream": True}).encode()
    with (
        upstream,
        CaptureProxy(store, ProxyOptions(upstream=url if token_ids else None, require_credentials=False)) as proxy,
    ):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
            t0 = time.monotonic()
            agent.sendall(
                b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (url.encode(), len(body), body)
            )
            first = agent.recv(65536)
            waited = time.monotonic() - t0
            received = first
            while not received.endswith(b"\r\n0\r\n\r\n") and (data := agent.recv(65536)):
                received += data
        thread.join(10)
        assert proxy.flush(timeout=10)
    assert first.startswith(b"HTTP/1.1 200")
    if first_write is None:
        assert b"data:" not in first and hold - CLOCK <= waited < gap  # the head came alone, when the hold ran out
    else:
        assert first_write in first  # not the head alone (a slow reader may find more behind it)
    assert b"data: [DONE]" in received
    (row,) = turns(store.path)
    assert row["stream"] and row["completion_text"] == "ok"


def test_the_body_may_come_long_after_the_head(store, llm):
    """The front opens a call on its head; the body arrives in a later write (as httpx sends it), or never (the
    agent left): then nothing is recorded and nothing stays in flight."""
    body = json.dumps(CHAT).encode()
    head = b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    with CaptureProxy(store, ANONYMOUS) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as gone:
            gone.sendall(head % (llm.url.encode(), len(body)))
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as slow:
            slow.sendall(head % (llm.url.encode(), len(body)))
            time.sleep(1.0)
            slow.sendall(body)
            answer = _read_answer(slow)
        assert proxy.flush(timeout=10)
    assert answer.startswith(b"HTTP/1.1 200") and TEXT.encode() in answer
    (row,) = turns(store.path)
    assert (row["seq"], row["completion_text"]) == (0, TEXT)
    assert row["latency_ms"] < 800  # the call starts once it is whole: the agent's pause is not the upstream's


def _read_answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    while len(data) < len(head) + 4 + length:
        data += sock.recv(65536)
    return data


def test_an_ended_episode_leaves_no_stitching_heads(store, llm):
    """The heads an episode's calls left for stitching go when its agent ends, the other episodes' stay."""
    from lcap.capture.routing.stitching import Head
    from lcap.processes import run_child

    proxy = CaptureProxy(store, ProxyOptions(upstream=llm.url))
    proxy.start()
    try:
        heads = proxy._calls.heads
        heads.put("live", Head(b"kept", key=1, items=3, turn_id="t0", thread_seq=0))
        with proxy.episode_child("ended", ["true"]) as child:
            heads.put("ended", Head(b"dropped", key=1, items=3, turn_id="t1", thread_seq=0))
            assert run_child(child.argv, child.env, pass_fds=child.pass_fds).code == 0
            assert heads.pick("ended", 1, 5) is not None
        assert heads.pick("ended", 1, 5) is None and heads.pick("live", 1, 5) is not None
        assert heads.bytes == len(b"kept")
    finally:
        proxy.stop()
