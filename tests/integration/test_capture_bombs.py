"""Compression bombs: `--max-body-bytes` bounds what a body decodes to, not what is sent.

A request of about a megabyte that inflates to a gibibyte gets a 413 and an error turn that keeps it as it came, on
the front and on mitmproxy (a chunked body), in gzip, brotli and zstd, while another agent's calls are answered
as usual; an upstream's answer that inflates to 512 MiB reaches the agent as it came and is stored as it came with
an error, the turns after it stored as always; when lcap must read that answer to rewrite it (`--token-ids`), the
agent gets a 502. The proxy and its writer run in a memory cgroup, so a decode without its bound is OOM-killed there.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import socket
import ssl
import threading
import time

import brotli
import httpx
import pytest
import zstandard
from fixtures_capture import SocketServer, read_head, serve_proxy, turns, wait_until
from fixtures_memory import FILL, PREFIX, SUFFIX, json_bomb, memory_cgroup

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store

LIMIT = 8 << 20  # the tests' --max-body-bytes
CGROUP = 512 << 20  # the proxy and its writer together: a gibibyte decoded whole cannot fit
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
ANSWER_PREFIX = b'{"id": "x", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "'
ANSWER_SUFFIX = b'"}, "finish_reason": "stop"}]}'


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    bomb = json_bomb("gzip", 1024)
    assert len(bomb) < 1_100_000
    return bomb


def test_the_bombs_are_what_they_say():
    """A small one of each decodes to the JSON it claims (the big ones are built the same way)."""
    whole = PREFIX + FILL * 3 + SUFFIX
    assert gzip.decompress(json_bomb("gzip", 3)) == whole
    frames = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(json_bomb("zstd", 3)), read_across_frames=True)
    assert frames.read() == whole
    assert brotli.decompress(json_bomb("br", 3)) == whole


def test_request_bombs_are_413_on_both_transports_while_other_calls_are_served(capture_env, llm, gzip_bomb):
    bombs = {
        ("gzip", "front"): gzip_bomb,
        ("gzip", "mitmproxy"): gzip_bomb,
        ("br", "front"): json_bomb("br", 1024),
        ("zstd", "mitmproxy"): json_bomb("zstd", 1024),
    }
    small = gzip.compress(json.dumps(CHAT).encode())
    url = f"{llm.url}/v1/chat/completions"
    latencies: list[float] = []
    failures: list[str] = []
    stop = threading.Event()
    with memory_cgroup(CGROUP) as cgroup:
        proc, port = serve_proxy(capture_env, "--max-body-bytes", str(LIMIT), preexec_fn=cgroup.enter)
        try:

            def other_agent() -> None:
                with httpx.Client(proxy=f"http://127.0.0.1:{port}", timeout=120) as client:
                    while not stop.is_set():
                        start = time.monotonic()
                        try:
                            answer = client.post(url, json=CHAT)
                        except httpx.HTTPError as exc:
                            failures.append(repr(exc))
                            return
                        latencies.append(time.monotonic() - start)
                        if answer.status_code != 200:
                            failures.append(answer.text)

            other = threading.Thread(target=other_agent)
            other.start()
            answers = {}
            with httpx.Client(proxy=f"http://127.0.0.1:{port}", timeout=120) as client:
                for (coding, transport), bomb in bombs.items():
                    pieces = [bomb[i : i + (1 << 16)] for i in range(0, len(bomb), 1 << 16)]
                    answers[coding, transport] = client.post(
                        url,
                        content=iter(pieces) if transport == "mitmproxy" else bomb,
                        headers={"content-type": "application/json", "content-encoding": coding},
                    )
                fine = [
                    client.post(url, content=iter([small]) if chunked else small, headers={"content-encoding": "gzip"})
                    for chunked in (False, True)
                ]
            # bombs refused fast leave the other agent few calls to make
            wait_until(lambda: len(latencies) >= 3 or failures or not other.is_alive(), timeout=60)
            stop.set()
            other.join(120)
        finally:
            stop.set()
            proc.terminate()
            _, stderr = proc.communicate(timeout=120)
    assert cgroup.oom_kills == 0 and proc.returncode == 0, stderr[-3000:]
    for key, answer in answers.items():
        assert answer.status_code == 413, (key, answer.status_code, answer.text[:300])
        assert f"body decodes past the limit of {LIMIT} bytes (--max-body-bytes)" in answer.text, key
        assert answer.text.count("\n") == 1  # one line
    assert [answer.status_code for answer in fine] == [200, 200]
    assert not failures and len(latencies) >= 3 and max(latencies) < 10, (failures, latencies)
    arrived = [call for call in llm.calls() if call["headers"].get("content-encoding") == "gzip"]
    assert [call["body"] for call in arrived] == [CHAT, CHAT]  # sent on as the agent sent them (FakeLLM decodes)
    rows = turns(capture_env["LCAP_DB"])
    refused = [row for row in rows if row["status_code"] == 413]
    assert len(refused) == len(bombs)
    for row in refused:
        coding = row["request"]["content_encoding"]
        assert f"the {coding} body decodes past the limit of {LIMIT} bytes" in row["error"]
        assert base64.b64decode(row["request"]["base64"]) in bombs.values()
    stored = [row for row in rows if row["status_code"] == 200]
    assert len(stored) == len(latencies) + 2 and all(row["request"] == CHAT for row in stored)


class BombUpstream:
    """A loopback upstream answering every POST with `body` under `content-encoding: gzip` (GET /v1/models, the
    proxy's look at an --upstream when it starts, with an empty list); `requests` holds each POST's head and body."""

    def __init__(self, body: bytes) -> None:
        self.requests: list[tuple[bytes, bytes]] = []
        self.answer = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.server = SocketServer(self._serve)
        self.url = self.server.url

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = read_head(conn)
            if head.startswith(b"GET"):
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 30\r\n\r\n" + b'{"object": "list", "data": []}')
                return
            head, _, body = head.partition(b"\r\n\r\n")
            head = head.lower()
            if b"content-length:" in head:
                length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                while len(body) < length and (chunk := conn.recv(65536)):
                    body += chunk
            else:  # chunked
                while not body.endswith(b"0\r\n\r\n") and (chunk := conn.recv(65536)):
                    body += chunk
                body = _unchunk(body)
            self.requests.append((head, body))
            conn.sendall(self.answer)

    def close(self) -> None:
        self.server.close()


def _unchunk(data: bytes) -> bytes:
    body = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if not size:
            return body
        body, data = body + data[:size], data[size + 2 :]


def test_an_answer_bomb_is_stored_as_it_came_and_the_writer_goes_on(capture_env, llm):
    """0.5 MB of gzip that inflates to 512 MiB: the agent gets those bytes as they came, the turn keeps them and says
    why it could not read them, and the next call's turn is stored as always. With --token-ids lcap must read the
    answer to pass it on: a 502 that says why, and the same turn."""
    bomb = json_bomb("gzip", 512, ANSWER_PREFIX, ANSWER_SUFFIX)
    assert len(bomb) < 600_000
    upstream = BombUpstream(bomb)
    try:
        with memory_cgroup(CGROUP) as cgroup:
            proc, port = serve_proxy(capture_env, "--max-body-bytes", str(LIMIT), preexec_fn=cgroup.enter)
            try:
                with httpx.Client(proxy=f"http://127.0.0.1:{port}", timeout=120) as client:
                    with client.stream("POST", f"{upstream.url}/v1/chat/completions", json=CHAT) as answer:
                        got = b"".join(answer.iter_raw())
                    assert answer.status_code == 200 and answer.headers["content-encoding"] == "gzip"
                    assert got == bomb
                    after = client.post(f"{llm.url}/v1/chat/completions", json=CHAT)
                    assert after.status_code == 200
            finally:
                proc.terminate()
                _, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stderr[-3000:]
            # in call order: --serve gives each of the two calls an episode of its own (its conversation)
            bombed, fine = sorted(turns(capture_env["LCAP_DB"]), key=lambda row: row["started_at"])
            proc, port = serve_proxy(
                capture_env, "--max-body-bytes", str(LIMIT), "--upstream", upstream.url, "--token-ids",
                preexec_fn=cgroup.enter,
            )  # fmt: skip
            try:
                with httpx.Client(proxy=f"http://127.0.0.1:{port}", timeout=120) as client:
                    refused = client.post(f"{llm.url}/v1/chat/completions", json=CHAT)
            finally:
                proc.terminate()
                _, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stderr[-3000:]
    finally:
        upstream.close()
    assert cgroup.oom_kills == 0
    assert f"the gzip body decodes past the limit of {LIMIT} bytes" in bombed["error"]
    assert bombed["status_code"] == 200 and bombed["request"] == CHAT
    assert bombed["response"]["content_encoding"] == "gzip"
    assert base64.b64decode(bombed["response"]["base64"]) == bomb
    assert fine["error"] is None and fine["completion_text"]
    assert refused.status_code == 502 and f"decodes past the limit of {LIMIT} bytes" in refused.text
    (rerouted,) = [
        row for row in turns(capture_env["LCAP_DB"]) if row["turn_id"] not in (bombed["turn_id"], fine["turn_id"])
    ]
    assert "lcap must read it to pass it on" in rerouted["error"]
    assert base64.b64decode(rerouted["response"]["base64"]) == bomb


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "mitmproxy"])
def test_compressed_bodies_lcap_rewrites_go_plain_and_corrupt_ones_are_a_400(
    tmp_path, capture_home, monkeypatch, chunked
):
    """With --token-ids lcap rewrites a gzip request: the upstream gets it plain, without its Content-Encoding; the
    upstream's gzip answer is decoded, rewritten and sent on plain. A request whose gzip is corrupt gets a 400 that
    says so, and its turn keeps the body as it came."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    answer = {"id": "x", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}  # fmt: skip
    upstream = BombUpstream(gzip.compress(json.dumps(answer).encode()))
    store = Store(tmp_path / "lcap.duckdb")
    request = gzip.compress(json.dumps(CHAT).encode())
    try:
        with CaptureProxy(store, ProxyOptions(upstream=upstream.url, token_ids=True)) as proxy:
            env = proxy.child_env("ep-bombs", base={})
            verify = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
            with httpx.Client(proxy=env["HTTPS_PROXY"], verify=verify, timeout=30) as client:
                replies = [
                    client.post(
                        "https://api.openai.com/v1/chat/completions",
                        content=iter([body]) if chunked else body,
                        headers={"content-type": "application/json", "content-encoding": "gzip"},
                    )
                    for body in (request, request[: len(request) // 2])
                ]
            assert proxy.flush(timeout=30)
    finally:
        upstream.close()
    served, corrupt = replies
    assert served.status_code == 200 and "content-encoding" not in served.headers
    assert served.json()["choices"][0]["message"]["content"] == "ok"
    ((head, sent),) = upstream.requests
    assert b"content-encoding" not in head and json.loads(sent)["messages"] == CHAT["messages"]
    assert corrupt.status_code == 400 and "the gzip body ends before its stream does" in corrupt.text
    rows = {row["status_code"]: row for row in turns(store.path)}
    assert rows[200]["request"] == CHAT and rows[200]["completion_text"] == "ok"
    assert "the gzip body ends before its stream does" in rows[400]["error"]
    assert base64.b64decode(rows[400]["request"]["base64"]) == request[: len(request) // 2]
