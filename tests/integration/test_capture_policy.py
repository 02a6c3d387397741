"""The in-process API that collect uses: `CaptureProxy` routed to the policy record, token ids, attribution.

The upstream here is FakeLLM answering like vLLM (fields `prompt_token_ids`, `token_ids`,
`logprobs` when asked): it checks lcap's own logic (what it asks for, what it strips from the
agent's answer, how `lcap deploy` switches routes) fast and deterministically. The same path
against the real vLLM server is in tests/e2e/test_capture_vllm.py.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
from datetime import UTC, datetime

import httpx
import pytest
from fixtures_capture import FakeLLM, agent, fake_ids, turns

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.policy import PolicyServer, write_policy
from lcap.store import Store

TEXT = "Hello from the upstream."


CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def vllm_like():
    server = FakeLLM(vllm=True)
    server.thread.start()
    yield server
    server.shutdown()


@pytest.fixture
def policy_record(tmp_path, monkeypatch, capture_home, vllm_like):
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    record = PolicyServer(
        url=vllm_like.url,
        pid=os.getpid(),
        base_model="tiny",
        served_model="tiny",
        current="lora-1",
        log_path="",
        python="",
        started_at=datetime.now(UTC).isoformat(),
    )
    write_policy(record)
    return record


def _client(proxy: CaptureProxy, episode: str | None) -> httpx.Client:
    env = proxy.child_env(episode, base={})
    return httpx.Client(
        proxy=env["HTTPS_PROXY"], verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"]), timeout=30
    )


def _sse_data(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and "[DONE]" not in line]


def test_policy_route_token_ids_and_clean_answers(tmp_path, policy_record, vllm_like):
    store = Store(tmp_path / "lcap.duckdb")
    with CaptureProxy(store, ProxyOptions(upstream="policy")) as proxy:
        assert proxy.token_ids  # auto: on for the policy
        with _client(proxy, "ep-1") as client:
            headers = {"authorization": "Bearer sk-agent-own-key-0123456789abcdef"}
            plain = client.post("https://api.openai.com/v1/chat/completions", json=CHAT, headers=headers).json()
            streamed = client.post("https://api.openai.com/v1/chat/completions", json={**CHAT, "stream": True}).text
            completion = client.post(
                "https://api.openai.com/v1/completions", json={"model": "x", "prompt": "hi"}
            ).json()
            response = client.post("https://api.openai.com/v1/responses", json={"model": "x", "input": "hi"}).json()
            message = client.post(
                "https://api.anthropic.com/v1/messages?beta=true",
                json={"model": "claude", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]},
            ).json()
            asked = client.post("https://api.openai.com/v1/chat/completions", json={**CHAT, "logprobs": True}).json()
    # what lcap asked vLLM for, under the deployment's name, without the agent's credentials
    sent = [c["body"] for c in vllm_like.calls()]
    assert [b["model"] for b in sent] == ["lora-1"] * 6
    assert sent[0]["return_token_ids"] is True and sent[0]["logprobs"] is True
    assert sent[2]["return_token_ids"] is True and sent[2]["logprobs"] == 0
    assert sent[3]["enable_response_messages"] is True
    assert "return_token_ids" not in sent[4]  # Anthropic Messages: vLLM cannot return ids
    assert all("authorization" not in {k.lower() for k in c["headers"]} for c in vllm_like.calls())
    # what the agent got: exactly the shape it asked for
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["message"]["content"] == TEXT
    chunks = _sse_data(streamed)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == TEXT
    assert not any("token_ids" in json.dumps(c) or (c["choices"] and c["choices"][0].get("logprobs")) for c in chunks)
    assert "token_ids" not in completion["choices"][0] and completion["choices"][0]["logprobs"] is None
    assert "input_messages" not in response and "output_messages" not in response
    assert message["content"][0]["text"] == TEXT
    assert asked["choices"][0]["logprobs"] is not None  # asked by the agent: kept
    # what was stored
    rows = turns(tmp_path / "lcap.duckdb")
    assert [r["seq"] for r in rows] == list(range(6)) and {r["episode_id"] for r in rows} == {"ep-1"}
    assert {r["deployment"] for r in rows} == {"lora-1"}
    for row in rows[:4] + rows[5:]:
        assert row["token_source"] == "vllm", row["dialect"]
        assert row["completion_token_ids"] == fake_ids(TEXT)
        assert row["prompt_token_ids"]
    assert rows[0]["completion_logprobs"] == [-0.5] * len(TEXT)
    assert rows[1]["completion_logprobs"] == [-0.5] * len(TEXT) and rows[1]["stream"]
    assert rows[2]["completion_logprobs"] == [-0.25] * len(TEXT)
    assert rows[3]["completion_logprobs"] is None  # Responses: ids without logprobs
    assert rows[4]["token_source"] is None and rows[4]["prompt_token_ids"] is None
    assert rows[4]["path"] == "/v1/messages?beta=true"
    assert rows[0]["model_requested"] == "gpt-4o-mini" and rows[0]["request"]["model"] == "gpt-4o-mini"


def test_traffic_that_is_not_an_llm_call_streams_through_unstored(tmp_path, capture_home, monkeypatch, llm):
    """A stream on a path no dialect claims reaches the client chunk by chunk (the upstream holds it after
    the first chunk until the client has read it) and is not a turn."""
    import threading

    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    llm.gate = threading.Event()
    store = Store(tmp_path / "lcap.duckdb")
    timer = threading.Timer(15, llm.gate.set)  # a buffering proxy gets its first chunk only after this
    try:
        with CaptureProxy(store) as proxy, _client(proxy, "ep-1") as client:
            timer.start()
            with client.stream("POST", f"{llm.url}/v1/events", json={"stream": True}) as resp:
                chunks = resp.iter_raw()
                first = next(chunks)
                assert b"data:" in first and not llm.gate.is_set()
                llm.gate.set()
                rest = b"".join(chunks)
            assert b"[DONE]" in first + rest
            assert proxy.flush(timeout=10)
    finally:
        timer.cancel()
        llm.gate.set()
    assert turns(tmp_path / "lcap.duckdb") == []


def test_deploy_switches_new_calls_without_restart(tmp_path, policy_record, vllm_like):
    store = Store(tmp_path / "lcap.duckdb")
    anonymous = ProxyOptions(upstream="policy", token_ids=False, require_credentials=False)
    with CaptureProxy(store, anonymous) as proxy, _client(proxy, None) as client:
        first = client.post("https://api.openai.com/v1/chat/completions", json=CHAT)
        assert first.status_code == 200, first.text
        assert proxy.flush(timeout=10)
        assert len(turns(tmp_path / "lcap.duckdb")) == 1  # in the store while the proxy still runs
        policy_record.current = "lora-2"
        write_policy(policy_record)
        time.sleep(0.7)
        client.post("https://api.openai.com/v1/chat/completions", json=CHAT)
    assert [c["body"]["model"] for c in vllm_like.calls()] == ["lora-1", "lora-2"]
    rows = turns(tmp_path / "lcap.duckdb")
    assert [r["deployment"] for r in rows] == ["lora-1", "lora-2"]
    assert all(r["episode_id"] is None and r["token_source"] is None for r in rows)


def test_attribution_by_url_credentials_header_or_none(tmp_path, capture_home, monkeypatch, vllm_like):
    """An episode is named with its secret, in the proxy URL or an X-Lcap-Episode header; a name with a wrong
    secret or none names nothing (here, with credentials optional, the call is stored unattributed)."""
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    store = Store(tmp_path / "lcap.duckdb")
    options = ProxyOptions(upstream=vllm_like.url, token_ids=False, require_credentials=False)
    with CaptureProxy(store, options) as proxy:
        env = proxy.child_env(None, base={})
        for episode, headers in (
            ("via-url", {}),
            (None, {"x-lcap-episode": proxy.episode_header("via-header")}),
            (None, {}),
            (None, {"x-lcap-episode": "spoofed"}),
            (None, {"x-lcap-episode": "spoofed:" + "0" * 32}),
        ):
            proxy_url = proxy.proxy_url(episode)
            with httpx.Client(
                proxy=proxy_url, verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
            ) as client:
                client.post("https://api.openai.com/v1/chat/completions", json=CHAT, headers=headers)
                client.post("https://api.openai.com/v1/chat/completions", json=CHAT, headers=headers)
        with httpx.Client(proxy=f"http://spoofed:{'0' * 32}@127.0.0.1:{proxy.port}") as client:
            client.post(f"{vllm_like.url}/v1/chat/completions", json=CHAT)
        # plain-HTTP absolute-form requests carry the credentials on every request
        with httpx.Client(proxy=proxy.proxy_url("plain-http")) as client:
            client.post(f"{vllm_like.url}/v1/chat/completions", json=CHAT)
    rows = turns(tmp_path / "lcap.duckdb")
    by_episode = {}
    for row in rows:
        by_episode.setdefault(row["episode_id"], []).append(row["seq"])
    assert by_episode == {"via-url": [0, 1], "via-header": [0, 1], None: [0, 1, 2, 3, 4, 5, 6], "plain-http": [0]}
    for call in vllm_like.calls():  # lcap's attribution never leaks upstream
        assert not {"x-lcap-episode", "proxy-authorization"} & {k.lower() for k in call["headers"]}


def test_child_env(tmp_path, capture_home, monkeypatch):
    monkeypatch.setenv("LCAP_HOME", str(capture_home))
    with CaptureProxy(Store(tmp_path / "db.duckdb")) as proxy:
        base = {
            "NO_PROXY": "localhost,.openai.com,internal.corp,*",
            "NODE_OPTIONS": "--max-old-space-size=512",
            "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
            "PATH": "/usr/bin",
        }
        env = proxy.child_env("ep 1/x", base=base)
    secret = proxy.keys.secret("ep 1/x")
    assert len(secret) == 32 and secret != proxy.keys.secret("ep 1/y")
    assert (
        env["HTTPS_PROXY"]
        == env["http_proxy"]
        == env["ALL_PROXY"]
        == f"http://ep%201%2Fx:{secret}@127.0.0.1:{proxy.port}"
    )
    assert env["NO_PROXY"] == "localhost,internal.corp" and env["PATH"] == "/usr/bin"
    bundle = env["SSL_CERT_FILE"]
    assert env["REQUESTS_CA_BUNDLE"] == env["CURL_CA_BUNDLE"] == env["NODE_EXTRA_CA_CERTS"] == bundle
    text = open(bundle).read()
    assert open(capture_home / "ca" / "mitmproxy-ca-cert.pem").read().strip() in text
    assert text.count("BEGIN CERTIFICATE") > 10  # the system roots are in there too
    assert env["NODE_OPTIONS"].startswith("--max-old-space-size=512 --require ") and env["NODE_OPTIONS"].endswith(
        "preload.js"
    )
    assert oct(os.stat(capture_home / "ca" / "mitmproxy-ca.pem").st_mode & 0o777) == "0o600"


def _finished_turn(episode: str, text: str = "hi"):
    from lcap.capture.turns.turn import PendingTurn

    pending = PendingTurn(episode_id=episode, seq=0, host="api.openai.com", path="/v1/chat/completions", dialect="chat")
    pending.request_body = json.dumps(CHAT).encode()
    pending.response_body = json.dumps(
        {"model": "m", "choices": [{"message": {"content": text}, "finish_reason": "stop"}]}
    ).encode()
    pending.status_code = 200
    return pending


def test_spool_left_by_a_dead_proxy_is_replayed_once(tmp_path, capture_home):
    """Turns spooled by a proxy whose writer died are written by the next proxy's writer, without duplicates."""
    from lcap.capture.storage.spool import SpoolAppender
    from lcap.capture.storage.writer import TurnWriter

    db, root = tmp_path / "db.duckdb", tmp_path / "spool"
    store = Store(db)
    dead = SpoolAppender(root / "999999999-deadbeef", db)  # no such pid: its proxy is gone
    lost, stored = _finished_turn("lost"), _finished_turn("stored", "already")
    dead.append(lost)
    dead.append(stored)
    dead.close()
    other = SpoolAppender(root / "999999998-0therdb0", tmp_path / "other.duckdb")  # another store's spool: left alone
    other.append(_finished_turn("other"))
    other.close()
    from lcap.capture.turns.turn import build_row

    store.append("turns", [build_row(stored)])  # written before the crash, still in the spool
    writer = TurnWriter(store, spool_root=root)
    writer.start()
    assert writer.stop(timeout=60)
    rows = turns(db)
    assert [(r["episode_id"], r["completion_text"]) for r in rows] == [("lost", "hi"), ("stored", "already")]
    assert sorted(p.name for p in root.iterdir()) == ["999999998-0therdb0", "key"]  # the spools' key stays


def test_turns_wait_while_another_process_holds_the_store(tmp_path, capture_home):
    """DuckDB refuses a second writer process: the turn waits in the spool and is written once the file is free."""
    import subprocess
    import sys

    from lcap.capture.storage.writer import TurnWriter

    db = tmp_path / "db.duckdb"
    Store(db).execute("SELECT 1")  # schema
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import duckdb, sys; c = duckdb.connect(sys.argv[1]); print('held', flush=True); sys.stdin.read()",
            str(db),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    writer = TurnWriter(Store(db, timeout=0.3), interval=0.05, spool_root=tmp_path / "spool")
    writer.start()
    writer.put(_finished_turn("waited"))
    assert not writer.flush(timeout=1.0) and writer.written == 0  # refused while held, kept
    holder.stdin.close()  # lets go
    holder.wait(10)
    assert writer.flush(timeout=20)
    assert writer.stop(timeout=30)
    (row,) = turns(db)
    assert row["episode_id"] == "waited" and row["completion_text"] == "hi"
    assert [p.name for p in (tmp_path / "spool").iterdir()] == ["key"]  # all stored: the spool is gone


def test_a_proxy_whose_model_is_a_loaded_adapter_sends_and_labels_calls_to_it(tmp_path, policy_record, vllm_like):
    """`lcap loop --live` evaluates a candidate through a proxy asking for it while routed calls keep the current
    deployment: the candidate's turns are labelled with it, and a model that is no adapter keeps today's label."""
    policy_record.loras = {"candidate": str(tmp_path / "adapter")}
    write_policy(policy_record)
    store = Store(tmp_path / "lcap.duckdb")
    for model in ("candidate", "tiny"):
        pinned = ProxyOptions(upstream="policy", model=model, token_ids=False, require_credentials=False)
        with CaptureProxy(store, pinned) as proxy, _client(proxy, None) as client:
            assert client.post("https://api.openai.com/v1/chat/completions", json=CHAT).status_code == 200
    assert [c["body"]["model"] for c in vllm_like.calls()] == ["candidate", "tiny"]
    assert [r["deployment"] for r in turns(tmp_path / "lcap.duckdb")] == ["candidate", "lora-1"]


def test_each_response_create_over_a_websocket_goes_to_its_roles_adapter(tmp_path, policy_record, vllm_like):
    """Serving per role on the Responses WebSocket (issue #52): the socket opens to the episode's replica, and each
    `response.create` asks for its own role's adapter there (`--role-by thread`: the agent's two prompts are two
    conversations, `main` then `subagent`); the turns name the adapter that served each."""
    policy_record.loras = {"lora-sub": str(tmp_path / "sub")}
    policy_record.roles = {"subagent": "lora-sub"}
    write_policy(policy_record)
    store = Store(tmp_path / "lcap.duckdb")
    options = ProxyOptions(upstream="policy", token_ids=False, require_credentials=False, role_by=("thread",))
    with CaptureProxy(store, options) as proxy:
        env = {**proxy.child_env(None, base=dict(os.environ)), "OPENAI_API_KEY": "sk-test-ws-roles"}
        done = subprocess.run(agent("ws_agent.py"), env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    rows = turns(tmp_path / "lcap.duckdb")
    assert [(r["transport"], r["role"], r["deployment"]) for r in rows] == [
        ("websocket", "main", "lora-1"),
        ("websocket", "subagent", "lora-sub"),
    ]
    frames = [f["body"] for f in vllm_like.requests if f["method"] == "WS" and f["body"].get("generate") is not False]
    assert [f.get("model") or f.get("response", {}).get("model") for f in frames] == ["lora-1", "lora-sub"]
