"""Fixtures of the capture tests: a real local LLM server, an isolated lcap home, helpers to run agents.

`FakeLLM` is a real HTTP/1.1 server on 127.0.0.1 that speaks OpenAI chat completions, legacy
completions, Responses and Anthropic Messages, streamed (SSE) and not. It stands in for the
hosted APIs, which this machine cannot reach; the agents still call their real default hosts
(api.openai.com, ...) through `lcap proxy --upstream`, so the whole capture path is real. It
records every request it receives and can answer like vLLM (prompt_token_ids, token_ids,
logprobs when asked with return_token_ids).
"""

from __future__ import annotations

import base64
import fcntl
import gzip
import hashlib
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lcap.capture.turns.turn import PendingTurn
from lcap.store import Store

REPO = Path(__file__).resolve().parents[1]
AGENTS = Path(__file__).resolve().parent / "agents_capture"
LCAP = os.environ.get("LCAP_TEST_CLI") or (
    str(REPO / ".venv" / "bin" / "lcap") if (REPO / ".venv" / "bin" / "lcap").exists() else shutil.which("lcap")
)
SECRET = "sk-test-SECRET-do-not-store-0123456789abcdef"
ANTHROPIC_SECRET = "sk-ant-api03-SECRET-do-not-store-abcdef0123456789"


class FakeLLM(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *, vllm: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.vllm = vllm
        self.requests: list[dict] = []
        self.text = "Hello from the upstream."
        self.tool_call: dict | None = None  # {"name": ..., "arguments": {...}} answers with a tool call
        # Messages calls only: request body -> the tool call to answer it with (None: the text), for a scripted
        # conversation (a harness's sub-agent, which the tiny policy never calls on purpose)
        self.script: Callable[[dict], dict | None] | None = None
        self.fail: tuple[int, dict] | None = None
        self.gzip = False
        self.gate: threading.Event | None = None  # streams pause after the first chunk until set
        self.end_gate: threading.Event | None = None  # chat streams pause before their `[DONE]` until set
        self.chunk_delay = 0.0
        self.line_end = "\n"  # "\r\n": SSE lines (and the blank line after each event) end in CRLF
        self.drop_idle = False  # close each connection after its answer, without saying so (a keep-alive timeout)
        self.models = ["fake-model"]  # what GET /v1/models lists
        self.response_ids: Iterator[int] | None = None  # Responses answers name themselves resp_N from it (else resp_1)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def calls(self, path_suffix: str = "") -> list[dict]:
        return [r for r in self.requests if r["path"].split("?")[0].endswith(path_suffix) and r["method"] == "POST"]

    def reset(self) -> None:
        self.requests.clear()
        self.response_ids = None
        self.script = None
        self.models = ["fake-model"]
        self.end_gate = None
        self.line_end = "\n"
        self.text, self.tool_call, self.fail, self.gzip, self.gate, self.chunk_delay, self.drop_idle = (
            "Hello from the upstream.",
            None,
            None,
            False,
            None,
            0.0,
            False,
        )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeLLM

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests.append({"method": "GET", "path": self.path, "headers": dict(self.headers), "body": None})
        if self.headers.get("upgrade", "").lower() == "websocket":
            return self._websocket()
        if self.path.rstrip("/").endswith("/models"):
            owner = "vllm" if self.server.vllm else "openai"
            data = [{"id": model, "object": "model", "owned_by": owner} for model in self.server.models]
            self._json(200, {"object": "list", "data": data})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        if "chunked" in self.headers.get("transfer-encoding", ""):
            raw = self._read_chunked()
        else:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.headers.get("content-encoding") == "gzip":
            raw = gzip.decompress(raw)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        self.server.requests.append({"method": "POST", "path": self.path, "headers": dict(self.headers), "body": body})
        path = self.path.split("?")[0].rstrip("/")
        if self.server.fail is not None:
            status, payload = self.server.fail
            return self._json(status, payload)
        if not isinstance(body, dict):
            return self._json(200, {"ok": True})  # side traffic (telemetry, ...)
        stream = bool(body.get("stream"))
        if path.endswith("/chat/completions"):
            return self._sse(_chat_events(self.server, body)) if stream else self._json(200, _chat(self.server, body))
        if path.endswith("/completions"):
            return (
                self._sse(_completion_events(self.server, body))
                if stream
                else self._json(200, _completion(self.server, body))
            )
        if path.endswith("/responses"):
            return (
                self._sse(_responses_events(self.server, body), named=True)
                if stream
                else self._json(200, _response(self.server, body))
            )
        if path.endswith("/messages"):
            return (
                self._sse(_messages_events(self.server, body), named=True)
                if stream
                else self._json(200, _message(self.server, body))
            )
        if path.endswith("/events"):  # not an LLM API: a plain event stream
            return self._sse(_chat_events(self.server, {**body, "model": "events"}))
        return self._json(200, {"ok": True})

    def _read_chunked(self) -> bytes:
        parts = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            parts.append(self.rfile.read(size))
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(parts)

    def _websocket(self) -> None:
        """Responses API over WebSocket: `response.create` frames in, the SSE events as frames out."""
        accept = base64.b64encode(
            hashlib.sha1((self.headers["sec-websocket-key"] + _WS_GUID).encode()).digest()
        ).decode()
        self.send_response(101)
        self.send_header("upgrade", "websocket")
        self.send_header("connection", "Upgrade")
        self.send_header("sec-websocket-accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            opcode, payload = _ws_read(self.rfile)
            if opcode is None or opcode == 8:
                _ws_write(self.wfile, b"", opcode=8)
                return
            if opcode != 1:
                continue
            frame = json.loads(payload)
            self.server.requests.append({"method": "WS", "path": self.path, "headers": {}, "body": frame})
            if frame.get("type") != "response.create" or frame.get("generate") is False:
                continue
            for event in _responses_events(self.server, frame):
                _ws_write(self.wfile, json.dumps(event).encode())

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        if self.server.gzip:
            data = gzip.compress(data)
            self.send_header("content-encoding", "gzip")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if self.server.drop_idle:
            self.close_connection = True

    def _sse(self, events: list[dict], named: bool = False) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        for i, event in enumerate(events):
            end = self.server.line_end
            head = f"event: {event['type']}{end}" if named else ""
            self.wfile.write(f"{head}data: {json.dumps(event)}{end}{end}".encode())
            self.wfile.flush()
            if i == 1 and self.server.gate is not None:  # after the first content chunk
                self.server.gate.wait(120)
            if self.server.chunk_delay:
                time.sleep(self.server.chunk_delay)
        if not named:
            if self.server.end_gate is not None:
                self.server.end_gate.wait(120)
            self.wfile.write(f"data: [DONE]{self.server.line_end * 2}".encode())
            self.wfile.flush()


_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def _ws_read(rfile) -> tuple[int | None, bytes]:
    head = rfile.read(2)
    if len(head) < 2:
        return None, b""
    opcode, length = head[0] & 0x0F, head[1] & 0x7F
    if length == 126:
        length = struct.unpack(">H", rfile.read(2))[0]
    elif length == 127:
        length = struct.unpack(">Q", rfile.read(8))[0]
    mask = rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
    data = rfile.read(length)
    return opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def _ws_write(wfile, data: bytes, opcode: int = 1) -> None:
    n = len(data)
    head = bytes([0x80 | opcode]) + (
        bytes([n])
        if n < 126
        else bytes([126]) + struct.pack(">H", n)
        if n < 65536
        else bytes([127]) + struct.pack(">Q", n)
    )
    wfile.write(head + data)
    wfile.flush()


# --- answers --------------------------------------------------------------------------------------
# Token ids are deterministic functions of the text, so tests can check what was stored.


def fake_ids(text: str) -> list[int]:
    return [ord(c) % 1000 for c in text]


def _words(text: str) -> list[str]:
    words = text.split(" ")
    return [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]


def _wants_ids(server: FakeLLM, body: dict) -> bool:
    return server.vllm and bool(body.get("return_token_ids"))


def _prompt_text(body: dict) -> str:
    return json.dumps(body.get("messages") or body.get("prompt") or body.get("input"))


def _chat(server: FakeLLM, body: dict) -> dict:
    message: dict = {"role": "assistant", "content": server.text}
    finish = "stop"
    if server.tool_call:
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": server.tool_call["name"],
                        "arguments": json.dumps(server.tool_call["arguments"]),
                    },
                }
            ],
        }
        finish = "tool_calls"
    choice: dict = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    out = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": body.get("model"),
        "choices": [choice],
        "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
    }
    if _wants_ids(server, body):
        out["prompt_token_ids"] = fake_ids(_prompt_text(body))
        choice["token_ids"] = fake_ids(server.text)
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [{"token": c, "logprob": -0.5, "bytes": None, "top_logprobs": []} for c in server.text]
            }
    return out


def _chat_events(server: FakeLLM, body: dict) -> list[dict]:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": body.get("model")}
    ids = _wants_ids(server, body)
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    if ids:
        events[0]["prompt_token_ids"] = fake_ids(_prompt_text(body))
    if server.tool_call:
        args = json.dumps(server.tool_call["arguments"])
        half = len(args) // 2
        events.append(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {"name": server.tool_call["name"], "arguments": args[:half]},
                                }
                            ]
                        },
                        "finish_reason": None,
                    }
                ],
            }
        )
        events.append(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": args[half:]}}]},
                        "finish_reason": None,
                    }
                ],
            }
        )
        events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    else:
        for word in _words(server.text):
            choice: dict = {"index": 0, "delta": {"content": word}, "finish_reason": None}
            if ids:
                choice["token_ids"] = fake_ids(word)
                if body.get("logprobs"):
                    choice["logprobs"] = {
                        "content": [{"token": c, "logprob": -0.5, "bytes": None, "top_logprobs": []} for c in word]
                    }
            events.append({**base, "choices": [choice]})
        events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(
            {**base, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}
        )
    return events


def _completion(server: FakeLLM, body: dict) -> dict:
    choice: dict = {"index": 0, "text": server.text, "finish_reason": "stop", "logprobs": None}
    if _wants_ids(server, body):
        choice["prompt_token_ids"] = fake_ids(_prompt_text(body))
        choice["token_ids"] = fake_ids(server.text)
        choice["logprobs"] = {"tokens": list(server.text), "token_logprobs": [-0.25] * len(server.text)}
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": body.get("model"),
        "choices": [choice],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }


def _completion_events(server: FakeLLM, body: dict) -> list[dict]:
    return [
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": body.get("model"),
            "choices": [{"index": 0, "text": word, "finish_reason": None}],
        }
        for word in _words(server.text)
    ] + [
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": body.get("model"),
            "choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
        }
    ]


def _response(server: FakeLLM, body: dict) -> dict:
    if server.tool_call:
        output = [
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": server.tool_call["name"],
                "arguments": json.dumps(server.tool_call["arguments"]),
                "status": "completed",
            }
        ]
    else:
        output = [
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": server.text, "annotations": []}],
            }
        ]
    out = {
        "id": f"resp_{next(server.response_ids)}" if server.response_ids is not None else "resp_1",
        "object": "response",
        "created_at": 1,
        "model": body.get("model"),
        "status": "completed",
        "output": output,
        "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13},
    }
    if server.vllm and body.get("enable_response_messages"):
        out["input_messages"] = [{"message": "prompt", "tokens": fake_ids(_prompt_text(body))}]
        out["output_messages"] = [{"message": server.text, "tokens": fake_ids(server.text)}]
    return out


def _responses_events(server: FakeLLM, body: dict) -> list[dict]:
    final = _response(server, body)
    created = {k: v for k, v in final.items() if k not in ("input_messages", "output_messages")}
    events = [
        {
            "type": "response.created",
            "sequence_number": 0,
            "response": {**created, "status": "in_progress", "output": []},
        },
        {
            "type": "response.output_item.added",
            "sequence_number": 1,
            "output_index": 0,
            "item": {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []},
        },
        {
            "type": "response.content_part.added",
            "sequence_number": 2,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []},
        },
    ]
    for word in _words(server.text):
        events.append(
            {
                "type": "response.output_text.delta",
                "sequence_number": len(events),
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": word,
            }
        )
    events.append({"type": "response.completed", "sequence_number": len(events), "response": final})
    return events


def _messages_tool_call(server: FakeLLM, body: dict) -> dict | None:
    return server.script(body) if server.script is not None else server.tool_call


def _message(server: FakeLLM, body: dict) -> dict:
    if tool_call := _messages_tool_call(server, body):
        content = [{"type": "tool_use", "id": "toolu_1", "name": tool_call["name"], "input": tool_call["arguments"]}]
        stop = "tool_use"
    else:
        content, stop = [{"type": "text", "text": server.text}], "end_turn"
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": 11, "output_tokens": 6},
    }


def _messages_events(server: FakeLLM, body: dict) -> list[dict]:
    start = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 11, "output_tokens": 1},
    }
    events = [{"type": "message_start", "message": start}]
    if tool_call := _messages_tool_call(server, body):
        args = json.dumps(tool_call["arguments"])
        events += [
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "tool_use", "id": "toolu_1", "name": tool_call["name"], "input": {}},
            },
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": args[:5]},
            },
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": args[5:]},
            },
            {"type": "content_block_stop", "index": 0},
        ]
        stop = "tool_use"
    else:
        events.append({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        events += [
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}}
            for w in _words(server.text)
        ]
        events.append({"type": "content_block_stop", "index": 0})
        stop = "end_turn"
    events += [
        {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 6}},
        {"type": "message_stop"},
    ]
    return events


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def capture_home(tmp_path_factory) -> Path:
    """An lcap home of the capture tests' own (CA, spool), shared by the whole session."""
    return tmp_path_factory.mktemp("lcap-home")


@pytest.fixture
def store(tmp_path, capture_home, monkeypatch) -> Store:
    """A fresh store under the session's capture home."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    return Store(tmp_path / "lcap.duckdb")


@pytest.fixture
def capture_env(capture_home, tmp_path, monkeypatch) -> dict[str, str]:
    """Environment for `lcap` child processes: isolated home, a fresh store, the test node modules."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    env = dict(os.environ)
    env["LCAP_HOME"] = str(capture_home)
    env["LCAP_DB"] = str(tmp_path / "lcap.duckdb")
    env["LCAP_NODE_DIR"] = str(node_cache_dir())
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "NO_PROXY", "no_proxy"):
        env.pop(name, None)
    env["OPENAI_API_KEY"] = SECRET
    env["ANTHROPIC_API_KEY"] = ANTHROPIC_SECRET
    return env


@pytest.fixture(scope="session")
def fake_llm():
    server = FakeLLM()
    server.thread.start()
    yield server
    server.shutdown()


@pytest.fixture
def llm(fake_llm) -> FakeLLM:
    fake_llm.reset()
    fake_llm.vllm = False
    return fake_llm


def node_cache_dir() -> Path:
    """npm packages for tests (undici for the preload, the openai SDK), cached across runs."""
    return Path(os.environ.get("LCAP_TEST_NODE_DIR") or Path.home() / ".cache" / "lcap-test-node")


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """Install the preload's undici and the openai Node SDK once (skip only if npm cannot). The cache is shared by
    runs and by the workers of one run: they take turns at it (a lock file beside it)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm are not installed")
    target = node_cache_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return install_node_modules(target)


def install_node_modules(target: Path) -> Path:
    env = {**os.environ, "LCAP_NODE_DIR": str(target)}
    setup = subprocess.run([LCAP, "setup", "node"], env=env, capture_output=True, text=True)
    if not all(
        (target / "node_modules" / name).exists() for name in ("undici", "https-proxy-agent", "http-proxy-agent")
    ):
        pytest.skip(f"npm could not install the preload's packages: {setup.stdout} {setup.stderr}")
    if _npm_version(target, "openai") != "6.30.1":
        result = subprocess.run(
            ["npm", "install", "--prefix", str(target), "--no-audit", "--no-fund", "--loglevel=error", "openai@6.30.1"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            pytest.skip(f"npm could not install the openai SDK: {result.stderr.strip()[-300:]}")
    return target / "node_modules"


def run_lcap(
    args: list[str], env: dict[str, str], *, timeout: float = 180, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run([LCAP, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def serve_proxy(
    env: dict[str, str], *args: str, host: str = "127.0.0.1", preexec_fn: Callable[[], None] | None = None
) -> tuple[subprocess.Popen, int]:
    """`lcap proxy --serve ARGS` as a child process (`preexec_fn` run in it first: `MemoryCgroup.enter`, say), and
    the port it listens on once it says so."""
    proc = subprocess.Popen(
        [LCAP, "proxy", "--serve", *(["--host", host] if host != "127.0.0.1" else []), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )
    said = f"listening on http://{host}:"
    line = proc.stdout.readline()
    if said not in line:
        proc.kill()
        raise AssertionError(line + proc.stderr.read())
    return proc, int(line.split(said, 1)[1].split()[0])


def raw_exchange(port: int, data: bytes, *, then: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send `data` to 127.0.0.1:`port` (then `then` after the first answer bytes); everything that comes back until
    the other side closes the connection or `timeout` passes without a byte."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
                if then:
                    sock.sendall(then)
                    then = b""
        except (TimeoutError, ConnectionResetError):
            pass
    return got


def agent(name: str) -> list[str]:
    """argv of a test agent script run by the project's Python."""
    return [sys.executable, str(AGENTS / name)]


def turns(db: str | Path, where: str = "true") -> list[dict]:
    """Stored turns as dicts, in (episode, seq) order."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        cur = con.execute(f"SELECT * FROM turns WHERE {where} ORDER BY episode_id, seq, started_at")
        cols = [d[0] for d in cur.description]
        rows = [dict(zip(cols, row)) for row in cur.fetchall()]
    finally:
        con.close()
    for row in rows:
        for col in ("request", "response", "tool_calls"):
            if isinstance(row[col], str):
                row[col] = json.loads(row[col])
    return rows


def store_text(db: str | Path) -> str:
    """Every value of every table, as text, plus the raw bytes of the file: for secret checks."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        parts = []
        for (table,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall():
            parts.append(str(con.execute(f"SELECT * FROM {table}").fetchall()))
    finally:
        con.close()
    return "\n".join(parts) + Path(db).read_bytes().decode("latin-1")


def _npm_version(target: Path, package: str) -> str | None:
    try:
        return json.loads((target / "node_modules" / package / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def wait_until(condition, timeout: float = 10.0) -> None:
    """Poll `condition` until it holds; fail past `timeout` seconds (a fixed sleep is a guess on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.02)


def open_files(kind: str) -> int:
    """How many of this process's open files are of `kind` ("socket", "pipe"): other threads' other files do not
    count."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{kind}:")
        except OSError:  # closed since it was listed
            continue
    return count


@pytest.fixture
def record_env(tmp_path, monkeypatch, capture_home):
    """The capture home, and a policy record of the test's own."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))


def is_private(path: Path) -> bool:
    """Nobody but the owner may read or write PATH."""
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def pending_turn(episode: str, text: str = "hi", **response: object) -> PendingTurn:
    """A finished chat call of EPISODE answering TEXT, as the proxy hands it to the spool."""
    pending = PendingTurn(episode_id=episode, seq=0, host="api.openai.com", path="/v1/chat/completions", dialect="chat")
    pending.request_body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    answer = {"model": "m", "choices": [{"message": {"content": text}, "finish_reason": "stop"}], **response}
    pending.response_body = json.dumps(answer).encode()
    pending.status_code = 200
    return pending


def dns_query(name: str, qtype: int = 1, ident: int = 0x1234) -> bytes:
    """A DNS query for NAME (type QTYPE), as a resolver sends it."""
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + labels + b"\x00" + struct.pack("!HH", qtype, 1)


class SocketServer:
    """A raw loopback TCP server on a port the kernel picks (port 0): a thread accepts connections until `close()`
    and hands each to `handle(conn)`, in the accept thread (one connection at a time) or, with `threaded`, on a
    thread of its own. The test upstreams and listeners that speak bytes, not HTTP, are built on it."""

    def __init__(
        self, handle: Callable[[socket.socket], None], *, threaded: bool = False, backlog: int | None = None
    ) -> None:
        self.handle, self.threaded = handle, threaded
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=backlog)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, name=f"socket-server-{self.port}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.threaded:
                threading.Thread(target=self.handle, args=(conn,), daemon=True).start()
            else:
                self.handle(conn)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> SocketServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_head(conn: socket.socket, data: bytes = b"") -> bytes:
    """What `conn` sends up to and including its first blank line (its head), or until it closes."""
    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
        data += chunk
    return data
