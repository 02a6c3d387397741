"""Bounded resources: connections, bodies, memory, certificates and per-episode state.

A proxy that anyone on its network (or any process on its machine) can reach must not be made to run out of
file descriptors or memory: connections past the limits are shed with a 503 (the limit fitted to the open-file
limit), bodies past `--max-body-bytes` are refused before they are read, on both transports, and memory
returns to its baseline after a big body. Caches are bounded: TLS certificates (the front's and mitmproxy's)
and the numbering of idle episodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import ssl
import subprocess
import time

import httpx
import pytest
from fixtures_capture import LCAP, SocketServer, turns, wait_until

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy import connections
from lcap.capture.proxy.server import CaptureProxy
from lcap.capture.trust.ca import CA_BASENAME, ca_dir
from lcap.capture.trust.certs import LeafCerts

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


BODY = json.dumps(CHAT).encode()


TEXT = "Hello from the upstream."


def serve_proxy(env: dict[str, str], *args: str, nofile: int | None = None) -> tuple[subprocess.Popen, int]:
    """`lcap proxy --serve ARGS` in a child process (its open-file limit set to `nofile`), and its port."""

    def limit() -> None:
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [LCAP, "proxy", "--serve", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
    )
    line = proc.stdout.readline()
    if "listening on http://127.0.0.1:" not in line:
        proc.kill()
        raise AssertionError(line + proc.stderr.read())
    return proc, int(line.split("listening on http://127.0.0.1:", 1)[1].split()[0])


def call_bytes(url: str, body: bytes = BODY, extra: bytes = b"") -> bytes:
    return b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\n%scontent-length: %d\r\n\r\n%s" % (
        url.encode(),
        extra,
        len(body),
        body,
    )


def answer(sock: socket.socket) -> bytes:
    """One answer with a Content-Length body, or what came before the connection closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    while len(rest) < length:
        rest += sock.recv(65536)
    return head + b"\r\n\r\n" + rest


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_slowloris_is_shed_and_never_exhausts_file_descriptors(capture_env, llm):
    """600 connections that never finish their head, against a proxy allowed 256 open files: the connection limit
    is lowered to fit (with a warning), connections past it get a 503 at once, those within it a 408 after
    `--head-timeout`, the proxy never holds more files than it may, and calls go through again afterwards."""
    proc, port = serve_proxy(capture_env, "--upstream", llm.url, "--head-timeout", "2", nofile=256)
    conns: list[socket.socket] = []
    try:
        peak = fds(proc.pid)
        for _ in range(600):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            conns.append(sock)
            peak = max(peak, fds(proc.pid))
        shed = held = 0
        for sock in conns:
            sock.settimeout(5)
            try:
                got = sock.recv(200)
            except (ConnectionResetError, TimeoutError):
                got = b""
            shed += got.startswith(b"HTTP/1.1 503")
            held += got.startswith(b"HTTP/1.1 408")
            peak = max(peak, fds(proc.pid))
        for sock in conns:  # the flood ends
            sock.close()
        time.sleep(1.5)
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", timeout=30) as client:
            after = client.post(f"{llm.url}/v1/chat/completions", json=CHAT)
    finally:
        for sock in conns:
            sock.close()
        proc.terminate()
        proc.wait(30)
    stderr = proc.stderr.read()
    limit = (256 - 64) // 4
    assert f"at most {limit} agent connections fit the open-file limit (256)" in stderr
    assert held == limit and shed >= 600 - limit - 60  # a few shed ones may be reset before their 503 is read
    assert peak < 256 and "Too many open files" not in stderr
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == TEXT


def test_one_client_cannot_take_every_connection(store, llm):
    """Past `--max-client-connections` from one address, that address's oldest idle connection is closed to make
    room; with none idle (each has begun a head), the newcomer gets a 503; another address is still served."""
    options = ProxyOptions(require_credentials=False, max_client_connections=3)
    with CaptureProxy(store, options) as proxy:
        mine = [socket.create_connection(("127.0.0.1", proxy.port), timeout=10) for _ in range(3)]
        try:
            wait_until(lambda: proxy.counters()["connections"] == 3)  # admitted, idle
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as fourth:
                fourth.sendall(call_bytes(llm.url))
                assert answer(fourth).startswith(b"HTTP/1.1 200 OK")
            mine[0].settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                assert mine[0].recv(100) == b""  # the oldest idle one made room
            assert proxy.counters()["connections_shed"] == 1
            mine[0] = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            for sock in mine:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # a head begun: not idle
            wait_until(lambda: proxy.counters()["connections"] == 3)
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as fifth:
                fifth.sendall(call_bytes(llm.url))
                assert answer(fifth).startswith(b"HTTP/1.1 503 Service Unavailable")
            with socket.create_connection(
                ("127.0.0.1", proxy.port), timeout=10, source_address=("127.0.0.2", 0)
            ) as other:
                other.sendall(call_bytes(llm.url))
                assert answer(other).startswith(b"HTTP/1.1 200 OK")
        finally:
            for sock in mine:
                sock.close()
        wait_until(lambda: proxy.counters()["connections"] == 0)  # their closes seen
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as again:
            again.sendall(call_bytes(llm.url))
            assert answer(again).startswith(b"HTTP/1.1 200 OK")


def test_bodies_past_the_limit_are_refused_on_both_transports(store, llm):
    """On the front by their Content-Length, before a byte of them is read; on mitmproxy (a chunked body, or a call
    on a connection handed over earlier) as soon as they pass the limit. Each is a 413 and an error turn."""
    options = ProxyOptions(require_credentials=False, max_body_bytes=100_000)
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}]}).encode()
    with CaptureProxy(store, options) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:  # the front
            agent.sendall(call_bytes(llm.url, big))
            front = answer(agent)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:  # mitmproxy, chunked
            agent.sendall(
                b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                % llm.url.encode()
            )
            for start in range(0, len(big), 10_000):
                piece = big[start : start + 10_000]
                agent.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            agent.sendall(b"0\r\n\r\n")
            chunked = answer(agent)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:  # mitmproxy, handed over
            agent.sendall(b"GET %s/v1/models HTTP/1.1\r\nhost: x\r\n\r\n" % llm.url.encode())
            models = answer(agent)
            try:
                agent.sendall(call_bytes(llm.url, big))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before the body was read
            later = answer(agent)
        assert proxy.flush(timeout=10)
    assert front.startswith(b"HTTP/1.1 413") and b"over the limit of 100000" in front
    assert models.startswith(b"HTTP/1.1 200") and b"fake-model" in models
    assert chunked.startswith(b"HTTP/1.1 413") and later.startswith(b"HTTP/1.1 413")
    assert llm.calls() == []
    rows = turns(store.path)
    assert [(r["status_code"], r["path"]) for r in rows] == [(413, "/v1/chat/completions")] * 3
    assert all("over the limit of 100000 bytes" in r["error"] for r in rows)


def test_answers_past_the_limit(store):
    """A whole answer over `--max-body-bytes` is not held: 502. A stream flows to the agent whole whatever its
    length; the turn keeps its start and says it was cut."""
    event = b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % (b"y" * 1000)
    huge = b"{" + b'"pad": "' + b"z" * 200_000 + b'"}'

    def serve(conn: socket.socket) -> None:
        with conn:
            request = conn.recv(65536)
            if b'"stream": true' in request:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
                for _ in range(300):
                    conn.sendall(event)
            else:
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(huge), huge)
                )

    with SocketServer(serve) as upstream:
        url = upstream.url
        options = ProxyOptions(require_credentials=False, max_body_bytes=100_000)
        with CaptureProxy(store, options) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
                agent.sendall(call_bytes(url))
                whole = answer(agent)
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
                agent.sendall(call_bytes(url, json.dumps({**CHAT, "stream": True}).encode()))
                streamed = b""
                while chunk := agent.recv(65536):
                    streamed += chunk
            assert proxy.flush(timeout=10)
    assert whole.startswith(b"HTTP/1.1 502") and b"--max-body-bytes" in whole
    assert streamed.count(b"data: ") == 300
    whole_row, stream_row = turns(store.path)
    assert "--max-body-bytes" in whole_row["error"]
    assert "the turn has its start" in stream_row["error"]
    assert 90_000 < len(stream_row["completion_text"]) <= 100_000  # its first 100,000 bytes, the last event cut


@pytest.mark.serial  # failed each time a second worker ran beside it, passed each time alone: not yet explained
def test_memory_returns_to_baseline_after_a_big_body(capture_env, llm):
    """A 40 MB call (under the default limit) and 200 MB offered past it, on the front and on mitmproxy: the proxy's
    resident memory comes back to where it was."""
    proc, port = serve_proxy(capture_env, "--upstream", llm.url)
    try:
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", timeout=60) as client:
            for _ in range(20):
                client.post(f"{llm.url}/v1/chat/completions", json=CHAT).raise_for_status()
            time.sleep(1)
            baseline = rss_mb(proc.pid)
            big = {**CHAT, "messages": [{"role": "user", "content": "x" * (40 << 20)}]}
            assert client.post(f"{llm.url}/v1/chat/completions", json=big).status_code == 200
        for chunked in (False, True):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as agent:
                framing = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % (1 << 30)
                agent.sendall(
                    b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\n%s\r\n\r\n" % (llm.url.encode(), framing)
                )
                piece = b"x" * (1 << 20)
                try:
                    for _ in range(200):
                        agent.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                refused = agent.recv(100)
            assert refused.startswith(b"HTTP/1.1 413"), refused
        deadline = time.monotonic() + 15  # the proxy looks at its memory every 5 s (capture/proxy/memory.py)
        while time.monotonic() < deadline and rss_mb(proc.pid) > baseline + 15:
            time.sleep(0.2)
        after = rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    assert after < baseline + 15, (baseline, after)


def test_certificate_caches_are_bounded(store):
    """The front keeps the TLS contexts of the `max_certs` hosts used last; mitmproxy's certificate store is
    bounded by the same option (here filled by HTTP/2-only tunnels, which mitmproxy terminates)."""
    certs = LeafCerts(ca_dir(), CA_BASENAME, max_certs=3)
    contexts = [certs.context(f"host{i}.example") for i in range(8)]
    assert list(certs.contexts) == ["host5.example", "host6.example", "host7.example"]
    assert certs.context("host7.example") is contexts[7] and len(certs.store.certs) <= 3
    with CaptureProxy(store, ProxyOptions(require_credentials=False, max_certs=3)) as proxy:
        bundle = proxy.child_env(None, base={})["SSL_CERT_FILE"]
        for i in range(6):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
                sock.sendall(b"CONNECT h%d.example:443 HTTP/1.1\r\nhost: h%d.example:443\r\n\r\n" % (i, i))
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")
                ctx = ssl.create_default_context(cafile=bundle)
                ctx.set_alpn_protocols(["h2"])
                with ctx.wrap_socket(sock, server_hostname=f"h{i}.example") as tls:
                    assert tls.selected_alpn_protocol() == "h2"
        store_certs = proxy._master.addons.get("tlsconfig").certstore.certs
        assert 0 < len(store_certs) <= 3
        tunnels = proxy._master.addons.get("captureaddon")._conn_episode  # per open tunnel, dropped with it
        deadline = time.monotonic() + 5
        while tunnels and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tunnels == {}


def test_idle_upstream_connections_are_closed_when_no_call_comes(monkeypatch):
    """The pool closes a connection idle for `POOL_AGE` even when no call takes from that upstream again: a proxy
    left idle keeps no upstream's fds (the soak counts them)."""
    monkeypatch.setattr(connections, "POOL_AGE", 0.5)

    async def main() -> None:
        server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)  # keeps them open
        key = ("http", "127.0.0.1", server.sockets[0].getsockname()[1])
        pool = connections.UpstreamPool()
        first, second = [await pool.open(key, "127.0.0.1") for _ in range(2)]
        pool.give_back(key, first)
        await asyncio.sleep(0.3)
        pool.give_back(key, second)  # younger than the first: the pool looks again when it comes of age
        await asyncio.sleep(2.0)
        closed = first.writer.is_closing(), second.writer.is_closing()
        left = pool.count, dict(pool.idle)
        pool.close()
        server.close()
        assert closed == (True, True) and left == (0, {})

    asyncio.run(main())
