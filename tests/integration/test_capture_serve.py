"""`lcap proxy --serve`: one long-running proxy for many agents, read by `lcap sql` while it writes."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import threading
import time

import httpx
from fixtures_capture import run_lcap, serve_proxy, turns

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def start_serve(env: dict[str, str], upstream: str) -> tuple[subprocess.Popen, int]:
    """`lcap proxy --serve --upstream UPSTREAM` as a child process, and the port it listens on."""
    return serve_proxy(env, "--upstream", upstream)


def new_episode(env: dict[str, str], port: int, *args: str) -> dict:
    """`lcap episode new --json` for the proxy on `port`."""
    result = run_lcap(["episode", "new", "--port", str(port), "--json", *args], env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_serve_attribution_side_traffic_and_sql_while_writing(capture_env, llm):
    db = capture_env["LCAP_DB"]
    proc, port = start_serve(capture_env, llm.url)
    try:
        bundle = proc.stdout.readline().split("SSL_CERT_FILE=", 1)[1].strip()
        verify = ssl.create_default_context(cafile=bundle)
        sent = {"agent-a": 0, "agent-b": 0}
        urls = {name: new_episode(capture_env, port, "--id", name, "--label", "task=7")["proxy_url"] for name in sent}
        stop = threading.Event()

        def agent(name: str) -> None:
            with httpx.Client(proxy=urls[name], verify=verify, timeout=30) as client:
                while not stop.is_set():
                    client.post("https://api.openai.com/v1/chat/completions", json=CHAT).raise_for_status()
                    side = client.post("https://api.openai.com/v1/telemetry", json={"event": "x"})
                    assert side.status_code == 502  # passed through untouched: api.openai.com is unreachable here
                    sent[name] += 1

        threads = [threading.Thread(target=agent, args=(name,)) for name in sent]
        for thread in threads:
            thread.start()
        counts = []
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and (len(counts) < 3 or counts[-1] == 0):
                result = run_lcap(["sql", "--format", "csv", "SELECT count(*) AS n FROM turns"], capture_env)
                assert result.returncode == 0, result.stderr
                counts.append(int(result.stdout.splitlines()[1]))
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert counts == sorted(counts) and counts[-1] > 0  # read while the proxy kept writing
        header = new_episode(capture_env, port, "--id", "by-header")["header"]
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", verify=verify) as client:
            client.post("https://api.openai.com/v1/chat/completions", json=CHAT, headers={"X-Lcap-Episode": header})
            client.post("https://api.openai.com/v1/chat/completions", json=CHAT)  # no credentials: its conversation
        proc.send_signal(signal.SIGINT)
        proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, proc.stderr.read()
    rows = turns(db)
    by_episode: dict = {}
    for row in rows:
        by_episode.setdefault(row["episode_id"], []).append(row["seq"])
    (conversation,) = set(by_episode) - {*sent, "by-header"}
    assert conversation.startswith("c-")  # --serve makes an episode of a conversation (test_capture_sessions.py)
    assert {k: len(v) for k, v in by_episode.items()} == {**sent, "by-header": 1, conversation: 1}
    for seqs in by_episode.values():
        assert sorted(seqs) == list(range(len(seqs)))
    assert all(r["path"] == "/v1/chat/completions" for r in rows)  # telemetry passed through, not stored
    labels = run_lcap(["sql", "-f", "csv", "SELECT episode_id, task_id FROM episodes ORDER BY 1"], capture_env)
    assert labels.stdout.splitlines()[1:] == ["agent-a,7", "agent-b,7", "by-header,", f"{conversation},"]
    assert llm.calls("/telemetry") == []  # side traffic went on to its own host (unreachable here), not rerouted


def test_kill_9_of_the_proxy_loses_no_finished_turn(capture_env, llm):
    """The spool and the writer process outlive lcap: turns finished before a kill -9 still reach the store."""
    db = capture_env["LCAP_DB"]
    proc, port = start_serve(capture_env, llm.url)
    try:
        url = new_episode(capture_env, port, "--id", "killed")["proxy_url"]
        with httpx.Client(proxy=url, timeout=30) as client:
            for _ in range(5):
                client.post(f"{llm.url}/v1/chat/completions", json=CHAT).raise_for_status()
        proc.kill()  # no flush, no clean stop: the last turns were finished a moment ago
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(rows := _turns_if_free(db)) < 5:
        time.sleep(0.2)
    assert [r["seq"] for r in rows if r["episode_id"] == "killed"] == [0, 1, 2, 3, 4]


def _turns_if_free(db) -> list[dict]:
    """The stored turns, or [] while the writer still holds the file."""
    import duckdb

    try:
        return turns(db)
    except duckdb.IOException:
        return []


def test_lcap_proxy_freezes_its_start_up_objects(capture_env, tmp_path):
    """mitmproxy, TLS and lcap leave many long-lived objects: `lcap proxy` freezes them once it is up, so that a
    full collection in a long run walks only what calls made (benchmarks/bench_gc_freeze.py)."""
    import gc
    import sys

    from lcap.capture.options import ProxyOptions
    from lcap.capture.run import run_proxy

    gc.unfreeze()
    try:
        code = run_proxy(
            [sys.executable, "-c", "pass"],
            labels={},
            episode=None,
            db=tmp_path / "freeze.duckdb",
            options=ProxyOptions(),
        )
        assert code == 0 and gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
