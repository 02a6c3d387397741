"""SSE events on the `--token-ids` path are rewritten and forwarded as each arrives, whichever line end the upstream
writes (the cut itself: tests/unit/test_capture_sse.py)."""

from __future__ import annotations

import json
import ssl
import threading

import httpx
import pytest
from fixtures_capture import FakeLLM, wait_until

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture
def vllm_like():
    server = FakeLLM(vllm=True)
    server.thread.start()
    yield server
    server.shutdown()


@pytest.mark.parametrize("end", ["\n", "\r\n"])
def test_token_ids_rewriter_streams_crlf_events_as_they_come(tmp_path, capture_home, monkeypatch, vllm_like, end):
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    vllm_like.line_end = end
    vllm_like.gate = threading.Event()
    store = Store(tmp_path / "lcap.duckdb")
    received: list[bytes] = []
    with CaptureProxy(store, ProxyOptions(upstream=vllm_like.url, token_ids=True)) as proxy:
        assert proxy.token_ids
        env = proxy.child_env("ep-sse", base={})
        verify = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
        with httpx.Client(proxy=env["HTTPS_PROXY"], verify=verify, timeout=30) as client:
            with client.stream("POST", "https://api.openai.com/v1/chat/completions", json=CHAT) as answer:
                chunks = answer.iter_raw()

                def first_events_arrive() -> bool:
                    received.append(next(chunks))
                    return b"".join(received).count(f"{end}{end}".encode()) >= 2

                wait_until(first_events_arrive, timeout=20)  # while the upstream holds the rest back
                vllm_like.gate.set()
                received.extend(chunks)
    body = b"".join(received).decode()
    events = [e for e in body.split(end * 2) if e]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads and all("token_ids" not in json.dumps(p) for p in payloads)  # lcap's fields taken out
    assert body.count(end * 2) == len(events)
    (row,) = store.fetchall("SELECT completion_text, completion_token_ids IS NOT NULL FROM turns")
    assert row == (vllm_like.text, True)
