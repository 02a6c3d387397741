"""An upstream or agent that breaks the protocol gets a clear answer, and the turn is stored with why: an upstream
that answers a plain POST with 101 Switching Protocols (502), a request body nested deeper than a JSON parser reads
(400, the raw body kept). On both transports: the front's own HTTP/1.1 path, and mitmproxy's, which takes a chunked
request body."""

from __future__ import annotations

import socket
import ssl

import httpx
import pytest
from fixtures_capture import SocketServer, read_head

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store

DEPTH = 200_000


MODELS = b'{"object": "list", "data": []}'


class RawUpstream:
    """A loopback upstream that answers every POST with `answer`, bytes as given (and GET /v1/models, the proxy's
    look at it when it starts, with an empty list)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.server = SocketServer(self._serve)
        self.url = self.server.url

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if read_head(conn).startswith(b"GET"):
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(MODELS), MODELS))
            else:
                conn.sendall(self.answer)

    def close(self) -> None:
        self.server.close()


def call(proxy: CaptureProxy, body: bytes, chunked: bool) -> httpx.Response:
    env = proxy.child_env("ep-abuse", base={})
    verify = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    content = iter([body[: len(body) // 2], body[len(body) // 2 :]]) if chunked else body
    with httpx.Client(proxy=env["HTTPS_PROXY"], verify=verify, timeout=30) as client:
        return client.post(
            "https://api.openai.com/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )


@pytest.fixture
def home(capture_home, monkeypatch):
    monkeypatch.setenv("LCAP_HOME", str(capture_home))


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "mitmproxy"])
def test_an_upstream_101_on_a_post_is_a_502_with_an_error_turn(tmp_path, home, chunked):
    upstream = RawUpstream(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\nxyz")
    store = Store(tmp_path / "lcap.duckdb")
    try:
        with CaptureProxy(store, ProxyOptions(upstream=upstream.url, token_ids=False)) as proxy:
            answer = call(proxy, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', chunked)
    finally:
        upstream.close()
    assert answer.status_code == 502
    assert "switched protocols (101)" in answer.text
    ((error,),) = store.fetchall("SELECT error FROM turns")
    assert "switched protocols (101)" in error


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "mitmproxy"])
def test_a_body_nested_past_the_parser_is_a_400_and_its_turn_keeps_the_raw_body(tmp_path, home, chunked):
    upstream = RawUpstream(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    store = Store(tmp_path / "lcap.duckdb")
    body = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * DEPTH + b"]" * DEPTH + b"}]}"
    try:
        with CaptureProxy(store, ProxyOptions(upstream=upstream.url, token_ids=False)) as proxy:
            answer = call(proxy, body, chunked)
    finally:
        upstream.close()
    assert answer.status_code == 400
    assert "nests JSON deeper" in answer.text
    ((status, error, request),) = store.fetchall("SELECT status_code, error, request FROM turns")
    assert status == 400 and "nests JSON deeper" in error
    assert request.count("[") == DEPTH + 1  # the messages list and the content
