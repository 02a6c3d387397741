"""Capture under hostile load (issue #33): what a hostile upstream or agent sends is bounded by what lcap keeps, not
by what it is sent, and one agent's abuse never stalls or refuses another's calls.

- Responses over WebSocket: a message past `--max-body-bytes` from either side closes the WebSocket with 1009 and
  lcap's reason, and a turn says why; a connection keeps none of the traffic it relayed.
- An upstream's answer head: past `--max-head-bytes`, or taking over `--head-timeout` once begun, a short 502/504
  and an error turn, on both transports (the front's path, and mitmproxy's for a chunked request).
- Idle connections: one process's idle connections are closed, oldest first, to make room for another agent's
  call; one episode's, for that episode's next; a new connection that says nothing waits `--head-timeout` only.

The memory-bound cases run the proxy (`lcap proxy --serve`, and its writer) in a memory cgroup
(tests/fixtures_memory.py): a regression gets it killed, and the test fails, instead of taking the machine.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fixtures_capture import LCAP, SocketServer, read_head, turns, wait_until
from fixtures_memory import memory_cgroup
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store

MiB = 1 << 20
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ANSWER = json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
MODELS = b'{"object": "list", "data": []}'
_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Hostile:
    """A loopback upstream that answers GET /v1/models, and everything else as `serve(conn, head)` says."""

    def __init__(self, serve: Callable[[socket.socket, bytes], None]) -> None:
        self.serve = serve
        self.server = SocketServer(self._one, threaded=True)
        self.url = self.server.url

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            data = read_head(conn)
            if data.startswith(b"GET /v1/models"):
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(MODELS), MODELS))
                return
            self.serve(conn, data)

    def close(self) -> None:
        self.server.close()


def accept_websocket(conn: socket.socket, head: bytes) -> tuple[int, bytes] | None:
    """Complete a WebSocket handshake; the agent's first frame (its opcode and payload, unmasked), None if none came."""
    key = b""
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"sec-websocket-key:"):
            key = line.split(b":", 1)[1].strip()
    accept = base64.b64encode(hashlib.sha1(key + _WS_GUID).digest())
    conn.sendall(
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        b"sec-websocket-accept: %s\r\n\r\n" % accept
    )
    reader = conn.makefile("rb")
    first = reader.read(2)
    if len(first) < 2:
        return None
    length = first[1] & 0x7F
    if length == 126:
        length = struct.unpack(">H", reader.read(2))[0]
    elif length == 127:
        length = struct.unpack(">Q", reader.read(8))[0]
    mask = reader.read(4)
    payload = reader.read(length)
    return first[0] & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def frame_head(length: int, opcode: int = 2, masked: bool = False) -> bytes:
    """A final frame's head; `masked`: an agent's (its mask key follows)."""
    mask = 0x80 if masked else 0
    if length < 126:
        return bytes([0x80 | opcode, mask | length])
    if length < 65536:
        return bytes([0x80 | opcode, mask | 126]) + struct.pack(">H", length)
    return bytes([0x80 | opcode, mask | 127]) + struct.pack(">Q", length)


@contextlib.contextmanager
def proxy_in_cgroup(env: dict[str, str], limit: int, *args: str) -> Iterator[tuple[int, object]]:
    """`lcap proxy --serve ARGS` (and its writer) in a memory cgroup of `limit` bytes: (its port, the cgroup). The
    proxy is stopped at the end of the block, so its turns are in the store."""
    with memory_cgroup(limit) as group:
        proc = subprocess.Popen(
            [LCAP, "proxy", "--serve", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=group.enter,
        )
        try:
            line = proc.stdout.readline()
            assert "listening on http://127.0.0.1:" in line, line + proc.stderr.read()
            yield int(line.split("listening on http://127.0.0.1:", 1)[1].split()[0]), group
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        assert not group.kills(), "the proxy was killed for memory"


def response_create(text: str = "hi") -> str:
    return json.dumps({"type": "response.create", "model": "m", "input": text})


# --- Responses over WebSocket -------------------------------------------------------------------------


def test_an_agent_message_past_the_limit_closes_the_websocket_with_1009(capture_env):
    """A 20 MB `response.create` against a 1 MiB `--max-body-bytes`: the agent's WebSocket is closed with 1009 and
    lcap's reason (read as it arrives: an agent still writing may then see its connection reset, as mitmproxy
    closes it), the upstream gets the same close and never the frame, and an error turn says why."""
    got: list[tuple[int, bytes]] = []

    def upstream(conn: socket.socket, head: bytes) -> None:
        if (frame := accept_websocket(conn, head)) is not None:
            got.append(frame)

    hostile = Hostile(upstream)
    reason = f"lcap: a message from the agent over {MiB} bytes (--max-body-bytes)".encode()
    try:
        with proxy_in_cgroup(capture_env, 400 * MiB, "--upstream", hostile.url, "--max-body-bytes", str(MiB)) as (
            port,
            _,
        ):
            agent = open_websocket(port, hostile.url)
            heard = bytearray()

            def listen() -> None:
                with contextlib.suppress(OSError):
                    while (data := agent.recv(65536)) and len(heard) < 1000:
                        heard.extend(data)

            listener = threading.Thread(target=listen)
            listener.start()
            frame = response_create("x" * (20 * MiB)).encode()
            with contextlib.suppress(OSError):
                agent.sendall(frame_head(len(frame), opcode=1, masked=True) + b"\0\0\0\0")
                for start in range(0, len(frame), MiB):
                    agent.sendall(frame[start : start + MiB])
            listener.join(30)
            agent.close()
    finally:
        hostile.close()
    close = b"\x03\xf1" + reason  # 1009, then the reason
    assert bytes(heard) == bytes([0x88, len(close)]) + close
    assert got == [(8, close)]  # a close, never the frame
    (row,) = turns(capture_env["LCAP_DB"])
    assert row["transport"] == "websocket" and row["request"] is None
    assert (
        row["error"]
        == f"a message from the agent over {MiB} bytes (--max-body-bytes); lcap closed the WebSocket (1009)"
    )


def open_websocket(port: int, url: str) -> socket.socket:
    """A raw agent's WebSocket to `url`/v1/responses through the proxy (a CONNECT tunnel), past its handshake."""
    where = url.removeprefix("http://").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"CONNECT %s HTTP/1.1\r\nhost: %s\r\n\r\n" % (where, where))
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.sendall(
        b"GET /v1/responses HTTP/1.1\r\nhost: %s\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n" % where
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def test_an_upstream_message_past_the_limit_closes_the_websocket_with_1009(capture_env):
    """A 300 MB frame from the upstream against a 1 MiB limit: the proxy holds none of it (its cgroup allows 200 MiB
    in all), the agent gets 1009 and lcap's reason, and the turn of the call says why."""

    def upstream(conn: socket.socket, head: bytes) -> None:
        accept_websocket(conn, head)
        conn.sendall(frame_head(300 * MiB, opcode=1))
        piece = b"y" * MiB
        for _ in range(300):
            conn.sendall(piece)

    hostile = Hostile(upstream)
    try:
        with proxy_in_cgroup(capture_env, 200 * MiB, "--upstream", hostile.url, "--max-body-bytes", str(MiB)) as (
            port,
            group,
        ):
            with connect(
                f"ws://{hostile.url.removeprefix('http://')}/v1/responses",
                proxy=f"http://127.0.0.1:{port}",
                compression=None,
                max_size=None,
            ) as ws:
                ws.send(response_create())
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=60)
            peak = group.peak()
    finally:
        hostile.close()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    assert closed.value.rcvd.reason == f"lcap: a message from the upstream over {MiB} bytes (--max-body-bytes)"
    assert peak < 200 * MiB
    (row,) = turns(capture_env["LCAP_DB"])
    assert row["transport"] == "websocket" and row["request"]["input"] == "hi"
    assert "a message from the upstream over 1048576 bytes" in row["error"]


def test_a_websocket_keeps_none_of_the_traffic_it_relayed(capture_env):
    """300 binary messages of 1 MiB on one connection reach the agent whole, through a proxy whose cgroup allows 200
    MiB in all: nothing relayed is kept until the socket closes."""

    def upstream(conn: socket.socket, head: bytes) -> None:
        accept_websocket(conn, head)
        piece = frame_head(MiB) + b"z" * MiB
        for _ in range(300):
            conn.sendall(piece)
        conn.sendall(b"\x88\x02\x03\xe8")  # close, 1000

    hostile = Hostile(upstream)
    received = 0
    try:
        with proxy_in_cgroup(capture_env, 200 * MiB, "--upstream", hostile.url, "--max-body-bytes", str(2 * MiB)) as (
            port,
            group,
        ):
            with connect(
                f"ws://{hostile.url.removeprefix('http://')}/v1/responses",
                proxy=f"http://127.0.0.1:{port}",
                compression=None,
                max_size=None,
            ) as ws:
                ws.send(response_create())
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        received += len(ws.recv(timeout=60))
            peak = group.peak()
    finally:
        hostile.close()
    assert received == 300 * MiB
    assert peak < 200 * MiB


# --- answer heads -------------------------------------------------------------------------------------


def endless_head(conn: socket.socket, head: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    line = b"x-pad: " + b"a" * 8000 + b"\r\n"
    while True:
        conn.sendall(line * 16)


def slow_head(conn: socket.socket, head: bytes) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nx-slow: " + b"s" * 200:
        conn.sendall(bytes([byte]))
        time.sleep(0.1)


def post(port: int, url: str, chunked: bool) -> httpx.Response:
    body = json.dumps(CHAT).encode()
    content = iter([body]) if chunked else body  # a chunked body goes to mitmproxy
    with httpx.Client(proxy=f"http://127.0.0.1:{port}", timeout=60) as client:
        return client.post(f"{url}/v1/chat/completions", content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "mitmproxy"])
def test_an_endless_answer_head_is_a_short_502(capture_env, chunked):
    """An upstream whose answer head never ends: past `--max-head-bytes` the agent gets a short 502 naming the
    limit, never the head, and the turn says so in a few words; the proxy's cgroup allows 300 MiB in all."""
    hostile = Hostile(endless_head)
    try:
        with proxy_in_cgroup(capture_env, 300 * MiB, "--upstream", hostile.url) as (port, group):
            answer = post(port, hostile.url, chunked)
            peak = group.peak()
    finally:
        hostile.close()
    assert answer.status_code == 502 and len(answer.content) < 2000
    assert "over 65536 bytes (--max-head-bytes)" in answer.text
    assert peak < 300 * MiB
    (row,) = turns(capture_env["LCAP_DB"])
    assert "over 65536 bytes (--max-head-bytes)" in row["error"] and len(row["error"]) < 1000


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "mitmproxy"])
def test_an_answer_head_that_trickles_is_cut_after_the_head_timeout(tmp_path, capture_home, monkeypatch, chunked):
    """An upstream that begins its head and sends a byte every 0.1 s: cut `--head-timeout` after its first byte
    (1 s here, well before `--first-byte-timeout`), a 504 and an error turn."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    hostile = Hostile(slow_head)
    store = Store(tmp_path / "lcap.duckdb")
    options = ProxyOptions(upstream=hostile.url, token_ids=False, require_credentials=False, head_timeout=1.0)
    try:
        with CaptureProxy(store, options) as proxy:
            started = time.monotonic()
            answer = post(proxy.port, hostile.url, chunked)
            took = time.monotonic() - started
    finally:
        hostile.close()
    assert answer.status_code == 504 and "--head-timeout" in answer.text
    assert took < 15
    ((error,),) = store.fetchall("SELECT error FROM turns")
    assert "answer head took over 1 s (--head-timeout)" in error


# --- idle connections -----------------------------------------------------------------------------------


def closed(sock: socket.socket, timeout: float) -> bool:
    """Whether the proxy closes `sock` within `timeout` seconds, without a word."""
    sock.settimeout(timeout)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_of_one_process_do_not_refuse_another_episode(tmp_path, capture_home, monkeypatch, llm):
    """One process holds `--max-client-connections` idle connections from 127.0.0.1, the address every local
    agent shares: another episode's agent is still answered at once (the oldest idle one is closed to make
    room), and a connection that never says anything is closed after `--head-timeout`, not `--idle-timeout`."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    store = Store(tmp_path / "lcap.duckdb")
    options = ProxyOptions(upstream=llm.url, token_ids=False, max_client_connections=20, head_timeout=6.0)
    with CaptureProxy(store, options) as proxy:
        opened = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", proxy.port), timeout=10) for _ in range(20)]
        try:
            wait_until(lambda: proxy.counters()["connections"] == 20)
            with httpx.Client(proxy=proxy.proxy_url("ep-b"), timeout=30) as client:
                started = time.monotonic()
                answers = [client.post("http://api.openai.com/v1/chat/completions", json=CHAT) for _ in range(3)]
                took = time.monotonic() - started
            assert [a.status_code for a in answers] == [200] * 3 and took < 10
            assert closed(idle[0], 5)  # the oldest idle one was closed to make room
            assert closed(idle[-1], 30)  # said nothing: closed after --head-timeout
            assert time.monotonic() - opened < 20
        finally:
            for sock in idle:
                sock.close()
        assert proxy.flush(timeout=10)
    assert [r["episode_id"] for r in turns(store.path)] == ["ep-b"] * 3


def test_one_episode_past_its_connections_sheds_its_own_idle_ones(tmp_path, capture_home, monkeypatch, llm):
    """An episode that keeps more connections open than `--max-episode-connections` has its own oldest idle ones
    closed for its next; another episode, over the same address, is not touched."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    store = Store(tmp_path / "lcap.duckdb")
    options = ProxyOptions(upstream=llm.url, token_ids=False, max_episode_connections=3, max_client_connections=3)
    with CaptureProxy(store, options) as proxy:
        clients = [httpx.Client(proxy=proxy.proxy_url(ep), timeout=30) for ep in ["ep-a"] * 6 + ["ep-b"]]
        try:
            last = clients[-1].post("http://api.openai.com/v1/chat/completions", json=CHAT)  # ep-b's one
            answers = [c.post("http://api.openai.com/v1/chat/completions", json=CHAT) for c in clients[:-1]]
            assert last.status_code == 200 and [a.status_code for a in answers] == [200] * 6
            wait_until(lambda: proxy.front.admission.by_group.get(("episode", "ep-a")) == 3)
            assert proxy.front.admission.by_group.get(("episode", "ep-b")) == 1
            again = clients[-1].post("http://api.openai.com/v1/chat/completions", json=CHAT)  # its kept connection
            assert again.status_code == 200
        finally:
            for client in clients:
                client.close()
