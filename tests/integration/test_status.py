"""`lcap status`: what runs for this LCAP_HOME, read from what lcap's processes announce. A real `lcap proxy --serve`
with a call held open upstream (the fake LLM's gate), real spools, policy records and stores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from fixtures_capture import serve_proxy

LCAP = str(Path(sys.executable).parent / "lcap")


def _status(env: dict[str, str], db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LCAP, "status", "--db", str(db), *args], env=env, capture_output=True, text=True, timeout=120
    )


def _json(env: dict[str, str], db: Path) -> dict:
    done = _status(env, db, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _until(probe, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_status_while_a_proxy_runs(capture_env, llm, tmp_path):
    env = {**capture_env, "LCAP_HOME": str(tmp_path / "home")}
    db = tmp_path / "lcap.duckdb"
    proxy, port = serve_proxy(env, "--port", "0", "--upstream", llm.url, "--db", str(db))
    record = tmp_path / "home" / "proxies" / f"{port}.json"
    try:
        assert _until(record.exists), proxy.stderr.read() if proxy.poll() is not None else "no record"
        assert record.stat().st_mode & 0o777 == 0o600
        state = _json(env, db)
        (shown,) = state["proxies"]
        assert (shown["port"], shown["pid"], shown["upstream"]) == (port, proxy.pid, llm.url)
        assert shown["command"].startswith("lcap proxy --serve") and "key" not in shown
        assert shown["counters"]["calls"] == 0 and shown["counters"]["writer_pid"]
        assert json.loads(record.read_text())["key"] not in _status(env, db, "--json").stdout

        url = subprocess.run(
            [LCAP, "episode", "new", "--port", str(port)], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        llm.gate = threading.Event()
        answers: list[int] = []

        def call() -> None:
            with httpx.Client(proxy=url, trust_env=False, timeout=60) as client:
                body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                with client.stream("POST", "http://api.openai.com/v1/chat/completions", json=body) as r:
                    r.read()
                    answers.append(r.status_code)

        caller = threading.Thread(target=call)
        caller.start()
        try:
            busy = _until(lambda: (c := _json(env, db)["proxies"][0]["counters"])["calls_in_flight"] == 1 and c)
            assert busy and busy["episodes_in_flight"] == 1 and busy["calls"] == 1 and busy["connections"] == 1, busy
            table = _status(env, db).stdout
            assert f"127.0.0.1:{port}" in table and str(proxy.pid) in table and "in flight" in table
        finally:
            llm.gate.set()
            caller.join(60)
        assert answers == [200]
        done = _until(lambda: (c := _json(env, db)["proxies"][0]["counters"])["turns_stored"] == 1 and c)
        assert done and done["calls_in_flight"] == 0 and done["turns_spooled"] == 1, done
        writers = _json(env, db)["writers"]
        assert [w["writer_pid"] for w in writers] == [done["writer_pid"]] and writers[0]["owner_running"]

        written = record.stat().st_mtime_ns  # an idle proxy rewrites nothing
        time.sleep(2.5)
        assert record.stat().st_mtime_ns == written
    finally:
        proxy.send_signal(signal.SIGINT)
        proxy.wait(60)
    assert not record.exists()
    assert _json(env, db)["proxies"] == []


def test_status_of_what_ended_badly(tmp_path, monkeypatch):
    """A record left by a proxy killed -9 is dropped; its spool shows as waiting for the next proxy; a policy record
    whose server is gone says so; the store's loop steps give each run's last step."""
    from lcap.capture.storage.spool import SpoolAppender
    from lcap.capture.trust.credentials import ProxyRecord, records_dir, write_record
    from lcap.policy import PolicyServer, write_policy
    from lcap.store import Store

    home = tmp_path / "home"
    monkeypatch.setenv("LCAP_HOME", str(home))
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(home / "policy.json"))
    env = dict(os.environ)
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_record(ProxyRecord(gone.pid, "127.0.0.1", 9, "00" * 32, "x.duckdb"))
    db = tmp_path / "lcap.duckdb"
    appender = SpoolAppender(home / "spool" / f"{gone.pid}-deadbeef", db)
    appender.append({"not": "a turn, but sealed all the same"})
    appender.close()
    write_policy(PolicyServer("http://127.0.0.1:9", gone.pid, "/m", "m", "m", "/tmp/vllm.log", "python", "2026-01-01"))
    store = Store(db)
    store.append(
        "loop_steps",
        [
            {"run": "/runs/a", "round": 1, "step": "collect", "mean_reward": 0.25, "details": "{}", "created_at": t}
            for t in ("2026-01-01 00:00:00+00", "2026-01-01 00:01:00+00")
        ]
        + [
            {
                "run": "/runs/a",
                "round": 2,
                "step": "train",
                "mean_reward": None,
                "details": "{}",
                "created_at": "2026-01-01 00:02:00+00",
            }
        ],
    )

    state = _json(env, db)
    assert state["proxies"] == [] and not list(records_dir().glob("*.json"))
    (spool,) = state["writers"]
    assert (spool["owner"], spool["owner_running"], spool["waiting"]) == (gone.pid, False, 1)
    assert state["policy"]["alive"] is False and "`lcap serve --stop` clears the record" in state["notes"]["policy"][0]
    assert [(s["run"], s["round"], s["step"]) for s in state["loop"]] == [("/runs/a", 2, "train")]

    text = _status(env, db).stdout
    assert "1 turns of an ended proxy wait in" in text and "not running (stale record)" in text
    assert "`lcap serve --stop` clears the record" in text

    watched = _status(env, db, "--watch", "--count", "2", "--interval", "0.2")
    assert watched.returncode == 0 and "turn writers" in watched.stdout
    bad = _status(env, db, "--watch", "--interval", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("lcap: --interval must be at least")
