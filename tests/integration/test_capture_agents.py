"""Real agents (openai / anthropic SDKs, curl, Node) run unmodified through `lcap proxy`.

Each agent calls its real default host (api.openai.com, api.anthropic.com); `--upstream` reroutes
the calls to a local server (FakeLLM: this machine has no internet), so mitmproxy, TLS
interception with lcap's CA, the child environment and the DuckDB store are all exercised for real.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import pytest
from fixtures_capture import ANTHROPIC_SECRET, LCAP, SECRET, agent, run_lcap, store_text, turns

TEXT = "Hello from the upstream."


def _assert_no_secret(db) -> None:
    text = store_text(db)
    for secret in (SECRET, ANTHROPIC_SECRET, "sk-user-pasted-secret"):
        assert secret not in text


def test_openai_sdk_chat_completions_responses(capture_env, llm):
    db = capture_env["LCAP_DB"]
    modes = ["chat", "chat_stream", "completions", "responses", "responses_stream", "models"]
    result = run_lcap(
        [
            "proxy",
            "--upstream",
            llm.url,
            "--episode",
            "ep-openai",
            "--label",
            "task=17",
            "--label",
            "round=2",
            "--",
            *agent("openai_agent.py"),
            *modes,
        ],
        capture_env,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for mode in ("chat", "chat_stream", "completions", "responses", "responses_stream"):
        assert f"{mode}: {TEXT}" in lines
    rows = turns(db)
    assert [(r["seq"], r["dialect"], r["stream"]) for r in rows] == [
        (0, "chat", False),
        (1, "chat", True),
        (2, "completions", False),
        (3, "responses", False),
        (4, "responses", True),
    ]
    for row in rows:
        assert row["episode_id"] == "ep-openai"
        assert row["host"] == "api.openai.com" and row["upstream"] == llm.url
        assert row["status_code"] == 200 and row["error"] is None
        assert row["completion_text"] == TEXT
        assert row["model_served"] == row["model_requested"] == row["request"]["model"]
        assert row["latency_ms"] > 0 and 0 < row["ttft_ms"] <= row["latency_ms"]
        assert row["token_source"] is None and row["prompt_token_ids"] is None
    chat_stream = rows[1]
    assert chat_stream["response"]["choices"][0]["message"]["content"] == TEXT  # reassembled to the plain shape
    assert (chat_stream["prompt_tokens"], chat_stream["completion_tokens"]) == (7, 5)
    assert rows[4]["finish_reason"] == "completed" and rows[4]["prompt_tokens"] == 9
    # side traffic (GET /v1/models) passed through to the original host, and was not stored
    assert "models failed" in result.stdout
    # the agent's key never reached the other host, nor the store
    for call in llm.calls():
        assert SECRET not in json.dumps(call["headers"])
    _assert_no_secret(db)
    (episode,) = _episodes(db)
    assert episode["status"] == "ok" and episode["exit_code"] == 0
    assert (episode["task_id"], episode["round"]) == ("17", 2)


def _episodes(db) -> list[dict]:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        cur = con.execute("SELECT * FROM episodes ORDER BY started_at")
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]
    finally:
        con.close()


def test_tool_calls_openai_and_anthropic(capture_env, llm):
    db = capture_env["LCAP_DB"]
    llm.tool_call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    first = run_lcap(
        ["proxy", "--upstream", llm.url, "--", *agent("openai_agent.py"), "tools", "tools_stream"], capture_env
    )
    second = run_lcap(["proxy", "--upstream", llm.url, "--", *agent("anthropic_agent.py"), "tools"], capture_env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.splitlines() == ['tool: get_weather {"city": "Paris"}'] * 2
    assert "tool: get_weather {'city': 'Paris'}" in second.stdout
    rows = sorted(turns(db), key=lambda r: r["started_at"])
    assert [r["dialect"] for r in rows] == ["chat", "chat", "messages"]
    for row in rows:
        (call,) = row["tool_calls"]
        assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert [r["finish_reason"] for r in rows] == ["tool_calls", "tool_calls", "tool_use"]
    assert rows[2]["response"]["content"][0]["input"] == {"city": "Paris"}  # partial JSON deltas joined


def test_anthropic_sdk_streaming(capture_env, llm):
    db = capture_env["LCAP_DB"]
    result = run_lcap(
        ["proxy", "--upstream", llm.url, "--model", "policy-v1", "--", *agent("anthropic_agent.py"), "stream", "plain"],
        capture_env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"stream: {TEXT}", f"plain: {TEXT}"]
    rows = turns(db)
    assert [(r["dialect"], r["stream"], r["finish_reason"]) for r in rows] == [
        ("messages", True, "end_turn"),
        ("messages", False, "end_turn"),
    ]
    for row in rows:
        assert row["host"] == "api.anthropic.com"
        assert row["model_requested"] == "claude-sonnet-4-5" and row["model_served"] == "policy-v1"
        assert (row["prompt_tokens"], row["completion_tokens"]) == (11, 6)
        assert row["completion_text"] == TEXT
    assert [c["body"]["model"] for c in llm.calls("/messages")] == ["policy-v1", "policy-v1"]
    assert all("x-api-key" not in {k.lower() for k in c["headers"]} for c in llm.calls())
    _assert_no_secret(db)


def test_curl_gzip_and_query_key(capture_env, llm):
    db = capture_env["LCAP_DB"]
    llm.gzip = True
    body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "api_key": SECRET})
    result = run_lcap(
        [
            "proxy",
            "--upstream",
            llm.url,
            "--",
            "curl",
            "-sS",
            "--compressed",
            f"https://api.openai.com/v1/chat/completions?api_key={SECRET}&x=1",
            "-H",
            f"Authorization: Bearer {SECRET}",
            "-H",
            "content-type: application/json",
            "-d",
            body,
        ],
        capture_env,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["choices"][0]["message"]["content"] == TEXT  # the agent got the gzip answer intact
    (row,) = turns(db)
    assert row["completion_text"] == TEXT and row["prompt_tokens"] == 7  # decoded for capture
    assert row["path"].startswith("/v1/chat/completions?") and "x=1" in row["path"]
    assert row["request"]["api_key"] == "[REDACTED]"
    _assert_no_secret(db)


def test_node_openai_sdk(capture_env, llm, node_modules):
    db = capture_env["LCAP_DB"]
    env = {**capture_env, "LCAP_TEST_NODE_MODULES": str(node_modules)}
    result = run_lcap(["proxy", "--upstream", llm.url, "--", "node", str(agent("openai_agent.cjs")[1])], env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [f"node chat: {TEXT}", f"node stream: {TEXT}"]
    rows = turns(db)
    assert [(r["dialect"], r["stream"], r["host"]) for r in rows] == [
        ("chat", False, "api.openai.com"),
        ("chat", True, "api.openai.com"),
    ]
    _assert_no_secret(db)


def test_node_https_module_client_and_no_proxy(capture_env, llm, node_modules):
    """Clients on Node's https module go through lcap too, also with their own agent; a host in NO_PROXY is reached directly."""
    db = capture_env["LCAP_DB"]
    host = llm.url.split("://", 1)[1].split(":")[0]
    env = {**capture_env, "LOCAL_LLM_URL": llm.url, "NO_PROXY": host}
    result = run_lcap(["proxy", "--upstream", llm.url, "--", "node", str(agent("https_module_agent.cjs")[1])], env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [f"https module: {TEXT}", f"no_proxy: {TEXT}", f"own agent: {TEXT}"]
    rows = turns(db)  # the NO_PROXY call never reached the proxy
    assert [(r["host"], r["completion_text"]) for r in rows] == [("api.openai.com", TEXT)] * 2
    _assert_no_secret(db)


def test_sse_chunks_are_not_buffered(capture_env, llm):
    """The upstream holds the stream after chunk 1 until the agent has printed it: buffering would deadlock."""
    llm.gate = threading.Event()
    proc = subprocess.Popen(
        [LCAP, "proxy", "--upstream", llm.url, "--", *agent("openai_agent.py"), "chat_stream"],
        env=capture_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        timer = threading.Timer(90, proc.kill)  # generous: this machine is shared and slow
        timer.start()
        for line in proc.stdout:
            seen.append(line.rstrip("\n"))
            if line.startswith("delta:"):
                break
        timer.cancel()
        assert seen and seen[-1].startswith("delta:"), f"no chunk reached the agent before the stream ended: {seen}"
        # The first delta carries role + "" content; the first text arrives before the gate opens.
        assert not llm.gate.is_set()
        llm.gate.set()
        out, err = proc.communicate(timeout=30)
    finally:
        llm.gate.set()
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0, err
    assert f"chat_stream: {TEXT}" in out
    (row,) = turns(capture_env["LCAP_DB"])
    assert row["completion_text"] == TEXT and row["stream"]


def test_upstream_error_stored_and_child_crash_keeps_finished_turns(capture_env, llm):
    llm.fail = (429, {"error": {"message": "rate limited, slow down", "type": "rate_limit"}})
    result = run_lcap(
        ["proxy", "--upstream", llm.url, "--episode", "crashy", "--", *agent("openai_agent.py"), "error", "crash"],
        capture_env,
    )
    assert "error: 429" in result.stdout  # the agent got the upstream's error as-is
    assert result.returncode == 3  # the child's own exit code
    (row,) = turns(capture_env["LCAP_DB"])  # finished before the crash: kept
    assert row["status_code"] == 429 and row["error"] == "rate limited, slow down"
    assert row["episode_id"] == "crashy"
    (episode,) = _episodes(capture_env["LCAP_DB"])
    assert (episode["status"], episode["exit_code"]) == ("failed", 3)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_reaches_child_and_turns_are_flushed(capture_env, llm, signum):
    proc = subprocess.Popen(
        [LCAP, "proxy", "--upstream", llm.url, "--episode", "sig", "--", *agent("openai_agent.py"), "chat", "wait"],
        env=capture_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        for line in proc.stdout:
            if line.strip() == "READY" or time.monotonic() > deadline:
                break
        proc.send_signal(signum)
        proc.wait(90)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 128 + signum  # the child died of the forwarded signal; lcap reports it
    (row,) = turns(capture_env["LCAP_DB"])
    assert row["episode_id"] == "sig" and row["completion_text"] == TEXT
    (episode,) = _episodes(capture_env["LCAP_DB"])
    assert episode["status"] == "interrupted" and episode["exit_code"] == 128 + signum


def test_one_line_errors(capture_env, llm, tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        in_use = run_lcap(["proxy", "--port", str(port), "--", "true"], capture_env)
    unreachable = run_lcap(["proxy", "--upstream", "http://127.0.0.1:1", "--", "true"], capture_env)
    bad_home = tmp_path / "home"
    bad_home.mkdir()
    (bad_home / "ca").write_text("not a directory")
    bad_ca = run_lcap(["proxy", "--", "true"], {**capture_env, "LCAP_HOME": str(bad_home)})
    unknown = run_lcap(["proxy", "--no-such-flag", "--", "true"], capture_env)
    missing = run_lcap(["proxy", "--", "no-such-agent-xyz"], capture_env)
    for result, needle in (
        (in_use, f"127.0.0.1:{port}"),
        (unreachable, "unreachable"),
        (bad_ca, "bad CA dir"),
        (missing, "cannot run no-such-agent-xyz"),
    ):
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], result.stderr
    assert unknown.returncode == 2 and "no-such-flag" in unknown.stderr


@pytest.mark.parametrize(("header", "roles"), [(None, ["main", "subagent"]), ("coder", ["coder", "coder"])])
def test_a_responses_websocket_call_takes_its_role_per_response_create(capture_env, llm, header, roles):
    """Issue #52: each `response.create` over a WebSocket takes the opening's X-Lcap-Role, else the --role-by rules
    (`thread`: its two prompts open two conversations); the header never reaches the upstream."""
    env = {**capture_env, **({"WS_ROLE": header} if header else {})}
    result = run_lcap(["proxy", "--upstream", llm.url, "--role-by", "thread", "--", *agent("ws_agent.py")], env)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = turns(capture_env["LCAP_DB"])
    assert [(r["transport"], r["role"]) for r in rows] == [("websocket", role) for role in roles]
    assert not any("x-lcap-role" in {k.lower() for k in f["headers"]} for f in llm.requests)


def test_capture_warnings_reach_stderr(capture_env):
    """mitmproxy routes the root logger into its own event log, which `lcap` does not show: lcap's warnings
    must still reach the terminal. A host name too long for a certificate makes one (the tunnel goes on)."""
    host = "a" * 64 + ".example"
    result = run_lcap(["proxy", "--", "curl", "-sS", "-m", "10", f"https://{host}/v1/models"], capture_env)
    assert f"lcap: no certificate for '{host}'" in result.stderr, result.stderr


def test_responses_over_websocket(capture_env, llm):
    db = capture_env["LCAP_DB"]
    result = run_lcap(
        ["proxy", "--upstream", llm.url, "--model", "policy-ws", "--", *agent("ws_agent.py")], capture_env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [f"ws: {TEXT}"] * 2
    rows = turns(db)
    assert [(r["seq"], r["dialect"], r["transport"], r["stream"]) for r in rows] == [
        (0, "responses", "websocket", True),
        (1, "responses", "websocket", True),
    ]  # the generate:false frame is no turn
    for row in rows:
        assert row["completion_text"] == TEXT and row["finish_reason"] == "completed"
        assert row["model_requested"] == "gpt-5" and row["model_served"] == "policy-ws"
        assert row["host"] == "api.openai.com" and row["ttft_ms"] <= row["latency_ms"]
    assert [r["request"]["input"] for r in rows] == ["Say hello", "Say it again"]
    assert [f["body"]["model"] for f in llm.requests if f["method"] == "WS"] == ["policy-ws"] * 3
    _assert_no_secret(db)
