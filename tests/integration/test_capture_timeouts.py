"""Upstreams that hang, agents that leave: every call ends, with an error turn, its time and its file descriptors.

An upstream that does not connect, does not answer or stops mid-stream is cut off after `--connect-timeout`,
`--first-byte-timeout` or `--stream-idle-timeout` (504 when the agent has had nothing yet). An agent that leaves
while its call runs cancels the call at once: the upstream connection is closed then, the turn says so with the
real latency, and no task is left behind for the garbage collector. Both transports: the front, and mitmproxy
(which gets a call whose body is chunked).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fixtures_capture import SocketServer, read_head, turns

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


BODY = json.dumps(CHAT).encode()


class Hung:
    """An upstream that reads each request and answers `prefix` (maybe nothing), then holds the connection; it
    notes when the proxy closes it."""

    def __init__(self, prefix: bytes = b"") -> None:
        self.prefix = prefix
        self.closed_at: list[float] = []
        self.requests = 0
        self.url = SocketServer(self._hold, threaded=True).url

    def _hold(self, conn: socket.socket) -> None:
        with conn:
            if b"\r\n\r\n" not in read_head(conn):
                return
            self.requests += 1
            conn.sendall(self.prefix)
            while conn.recv(65536):
                pass
            self.closed_at.append(time.monotonic())


def call_bytes(url: str, *, chunked: bool = False, stream: bool = False) -> bytes:
    body = json.dumps({**CHAT, "stream": stream}).encode()
    if chunked:  # a chunked body: mitmproxy carries the call
        return (
            b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
            % (url.encode(), len(body), body)
        )
    return b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (
        url.encode(),
        len(body),
        body,
    )


def read_all(sock: socket.socket) -> bytes:
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return got


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def pending_tasks(proxy: CaptureProxy) -> int:
    """Tasks not done in the proxy's event loop."""

    async def count() -> int:
        return len([t for t in asyncio.all_tasks() if not t.done()]) - 1

    assert proxy.loop is not None
    return asyncio.run_coroutine_threadsafe(count(), proxy.loop).result(5)


@contextmanager
def settled(proxy: CaptureProxy) -> Iterator[None]:
    """What the block opens in the proxy is closed within 3 s of its end: file descriptors and tasks (no more than
    before; another thread of the test process may have closed one of its own meanwhile)."""
    fds, tasks = open_fds(), pending_tasks(proxy)
    yield
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and (open_fds() > fds or pending_tasks(proxy) > tasks):
        time.sleep(0.05)
    assert open_fds() <= fds and pending_tasks(proxy) <= tasks, (open_fds(), fds, pending_tasks(proxy), tasks)


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "mitmproxy"])
def test_an_agent_that_leaves_cancels_its_call_at_once(store, chunked):
    """The agent gives up after 0.5 s on an upstream that never answers: the upstream connection is closed at once,
    the turn is an error with the real latency, nothing is left open."""
    hung = Hung()
    with CaptureProxy(store, ProxyOptions(require_credentials=False)) as proxy, settled(proxy):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
            agent.sendall(call_bytes(hung.url, chunked=chunked))
            time.sleep(0.5)
            left = time.monotonic()
        deadline = time.monotonic() + 5
        while not hung.closed_at and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hung.closed_at and hung.closed_at[0] - left < 1.5  # at once: the upstream would wait for minutes
        assert proxy.flush(timeout=10)
    (row,) = turns(store.path)
    assert row["error"] == "the agent closed the connection before the answer"
    assert 300 < row["latency_ms"] < 1500  # the agent left after 0.5 s (the mitmproxy hand-off starts it later)


def test_an_agent_that_closed_before_its_call_started_gets_no_call(store):
    """The agent writes its call and closes its side at once, and the proxy reads both together (its event loop is
    held meanwhile): the call is never sent upstream."""
    hung = Hung()
    with CaptureProxy(store, ProxyOptions(require_credentials=False)) as proxy:
        assert proxy.loop is not None
        proxy.loop.call_soon_threadsafe(time.sleep, 0.5)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
            agent.sendall(call_bytes(hung.url))
            agent.shutdown(socket.SHUT_WR)
            assert read_all(agent) == b""
        assert proxy.flush(timeout=10)
    (row,) = turns(store.path)
    assert row["error"] == "the agent closed the connection before the answer" and hung.requests == 0


def test_an_upstream_that_never_answers_gets_a_504(store):
    hung = Hung()
    options = ProxyOptions(require_credentials=False, first_byte_timeout=1.0)
    with CaptureProxy(store, options) as proxy, settled(proxy):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
            t0 = time.monotonic()
            agent.sendall(call_bytes(hung.url))
            answer = agent.recv(65536)
            took = time.monotonic() - t0
        assert proxy.flush(timeout=10)
    assert answer.startswith(b"HTTP/1.1 504 Gateway Timeout") and b"--first-byte-timeout" in answer
    assert 0.9 < took < 3
    (row,) = turns(store.path)
    assert "no answer within 1 s (--first-byte-timeout)" in row["error"] and 900 < row["latency_ms"] < 3000


def test_an_upstream_that_stops_mid_stream_is_cut_off(store):
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    event = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
    hung = Hung(head + b"%x\r\n%s\r\n" % (len(event), event))
    options = ProxyOptions(require_credentials=False, stream_idle_timeout=1.0)
    with CaptureProxy(store, options) as proxy, settled(proxy):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
            t0 = time.monotonic()
            agent.sendall(call_bytes(hung.url, stream=True))
            got = read_all(agent)
            took = time.monotonic() - t0
        assert proxy.flush(timeout=10)
    assert got.startswith(b"HTTP/1.1 200 OK") and b'"content":"ok"' in got and not got.endswith(b"0\r\n\r\n")
    assert 0.9 < took < 3  # the agent's connection is cut: it sees the stream did not end
    (row,) = turns(store.path)
    assert "silent for 1 s" in row["error"] and row["completion_text"] == "ok"


def test_mitmproxy_cuts_a_call_past_its_deadline_too(store):
    hung = Hung()
    options = ProxyOptions(require_credentials=False, first_byte_timeout=1.0)
    with CaptureProxy(store, options) as proxy, settled(proxy):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
            t0 = time.monotonic()
            agent.sendall(call_bytes(hung.url, chunked=True))
            answer = agent.recv(65536)
            took = time.monotonic() - t0
        assert proxy.flush(timeout=10)
    assert answer.startswith(b"HTTP/1.1 502") and 0.9 < took < 3
    (row,) = turns(store.path)
    assert "(--first-byte-timeout)" in row["error"]


def test_an_upstream_that_does_not_connect_gets_a_504(store):
    """A listener whose accept queue is full drops new connection attempts: they hang until the connect timeout."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        address = full.getsockname()
        fillers = []
        for _ in range(4):  # fill the accept queue (never accepted)
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(address)
            fillers.append(filler)
        time.sleep(0.2)
        options = ProxyOptions(require_credentials=False, connect_timeout=1.0)
        try:
            with CaptureProxy(store, options) as proxy:
                with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as agent:
                    t0 = time.monotonic()
                    agent.sendall(call_bytes(f"http://{address[0]}:{address[1]}"))
                    answer = agent.recv(65536)
                    took = time.monotonic() - t0
                assert proxy.flush(timeout=10)
        finally:
            for filler in fillers:
                filler.close()
    assert answer.startswith(b"HTTP/1.1 504") and b"--connect-timeout" in answer and 0.9 < took < 3
