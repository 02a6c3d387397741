"""Implicit rewards on live traffic: `lcap proxy --serve --implicit-reward judge:RUBRIC.md` on a real store, a real
local LLM behind it, sessions by header made by a scripted client, and a real HTTP judge endpoint in this test
whose verdict follows the user's next message as the prompt quotes it (so the assertions are lcap's guarantees:
one reward per judged turn, source `implicit`, a garbage answer leaves the turn unrewarded with its reason, the
proxy's stop ends the judge)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from fixtures_capture import SECRET, node_cache_dir, serve_proxy, wait_until

from lcap.store import Store

LCAP = str(Path(sys.executable).parent / "lcap")
KEY = "sk-implicit-tenant-0123456789"


class Judge:
    """An OpenAI-compatible chat endpoint: satisfied (1.0) where the quoted user's next message thanks, corrected
    (0.0) otherwise; `garbage` answers prose. It keeps every prompt. `GET /v1/models` reports `context` as its
    model's max_model_len, as vLLM does (None: no models list)."""

    def __init__(self) -> None:
        self.garbage = False
        self.prompts: list[str] = []
        self.context: int | None = None
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/v1/models" or judge.context is None:
                    self.send_error(404)
                    return
                data = json.dumps({"data": [{"id": "judge-m", "max_model_len": judge.context}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                prompt = body["messages"][-1]["content"]
                judge.prompts.append(prompt)
                said = prompt[prompt.index("<user_next_message>") : prompt.index("</user_next_message>")]
                verdict = (
                    {"feedback": "satisfied", "reasons": "thanked", "score": 1.0}
                    if "thanks" in said
                    else {"feedback": "corrected", "reasons": "said wrong", "score": 0.0}
                )
                content = "Lovely chat, 10/10." if judge.garbage else json.dumps(verdict)
                data = json.dumps(
                    {"choices": [{"message": {"role": "assistant", "content": content}}], "usage": {}}
                ).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def judge():
    server = Judge()
    yield server
    server.server.shutdown()


def _chat(*texts: str) -> dict:
    roles = ["user", "assistant"] * len(texts)
    return {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}]
        + [{"role": role, "content": text} for role, text in zip(roles, texts, strict=False)],
    }


def _call(proxy: str, upstream: str, body: dict, session: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "X-Lcap-Session": session}
    with httpx.Client(proxy=proxy, timeout=30) as client:
        client.post(f"{upstream}/v1/chat/completions", json=body, headers=headers).raise_for_status()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_the_users_next_message_is_judged_once_per_turn_and_the_proxys_stop_ends_the_judge(
    capture_home, tmp_path, fake_llm, judge
):
    fake_llm.reset()
    db = tmp_path / "lcap.duckdb"
    rubric = tmp_path / "support.md"
    rubric.write_text("The assistant answers the user's question correctly and helpfully.")
    env = dict(os.environ, LCAP_HOME=str(capture_home), LCAP_DB=str(db), LCAP_NODE_DIR=str(node_cache_dir()))
    env.update(PYTHONUNBUFFERED="1", OPENAI_API_KEY=SECRET)
    spec = f"judge:{rubric} --judge-url {judge.url} --judge-model judge-m --poll 0.2 --judge-retries 0"
    proc, port = serve_proxy(env, "--upstream", fake_llm.url, "--implicit-reward", spec)
    proxy = f"http://127.0.0.1:{port}"
    try:
        helpers = [pid for pid in _children(proc.pid) if "judge-live" in _cmdline(pid)]
        assert len(helpers) == 1
        _call(proxy, fake_llm.url, _chat("What is 2+2?"), "s-right")
        _call(proxy, fake_llm.url, _chat("What is 2+2?", "4", "thanks, that's right"), "s-right")
        _call(proxy, fake_llm.url, _chat("Capital of Spain?"), "s-wrong")
        _call(proxy, fake_llm.url, _chat("Capital of Spain?", "Lisbon", "no, wrong: it is Madrid"), "s-wrong")
        store = Store(db)
        rewards = "SELECT e.labels->>'session', r.value, r.source, r.key, r.details FROM rewards r JOIN episodes e USING (episode_id)"
        wait_until(lambda: len(store.fetchall(rewards)) >= 2, timeout=60)
        rows = {
            session: (value, source, key, json.loads(details))
            for session, value, source, key, details in store.fetchall(rewards)
        }
        assert {s: (v, src) for s, (v, src, _, _) in rows.items()} == {
            "s-right": (1.0, "implicit"),
            "s-wrong": (0.0, "implicit"),
        }
        assert rows["s-right"][3]["feedback"] == "satisfied" and rows["s-wrong"][3]["feedback"] == "corrected"
        assert len(judge.prompts) == 2  # the first call of a session has no assistant turn before its user message
        # the user's message is quoted as data: its text inside the block, as JSON
        assert any('"thanks, that\'s right"' in p for p in judge.prompts)
        # every judge call is an episode of its own, its call captured, linked to the judged turn
        judged = store.fetchall(
            "SELECT e.labels->>'judged_turn', count(t.turn_id) FROM episodes e LEFT JOIN turns t USING (episode_id) "
            "WHERE e.labels->>'role' = 'judge' GROUP BY ALL"
        )
        assert sorted(turn for turn, _ in judged) == sorted(d["turn"] for *_, d in rows.values())

        # judged again, alone (the store's keys): nothing new, no judge call
        again = subprocess.run(
            [LCAP, "judge-live", f"judge:{rubric}", "--judge-url", judge.url, "--judge-model", "judge-m", "--once"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 0, again.stderr
        assert len(store.fetchall("SELECT * FROM rewards")) == 2 and len(judge.prompts) == 2

        # a garbage answer: the turn is left unrewarded, its reason flagged, and it is not judged again
        judge.garbage = True
        _call(proxy, fake_llm.url, _chat("Capital of Peru?"), "s-garbage")
        _call(proxy, fake_llm.url, _chat("Capital of Peru?", "Lima", "thanks"), "s-garbage")
        flags = "SELECT f.details FROM episode_flags f WHERE f.flag = 'judge_error'"
        wait_until(lambda: store.fetchall(flags), timeout=60)
        (details,) = store.fetchall(flags)[0]
        assert "not a JSON object" in json.loads(details)["error"]
        assert len(store.fetchall("SELECT * FROM rewards")) == 2
        calls = len(judge.prompts)
        once = subprocess.run(
            [LCAP, "judge-live", f"judge:{rubric}", "--judge-url", judge.url, "--judge-model", "judge-m", "--once"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert once.returncode == 0 and len(judge.prompts) == calls
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() and "judge-live" in _cmdline(pid) for pid in helpers), 30)


def test_a_judge_that_cannot_start_stops_the_proxy_with_the_reason(capture_home, tmp_path, fake_llm):
    env = dict(os.environ, LCAP_HOME=str(capture_home), LCAP_DB=str(tmp_path / "lcap.duckdb"))
    missing = tmp_path / "missing.md"
    args = ["proxy", "--serve", "--upstream", fake_llm.url, "--implicit-reward", f"judge:{missing} --judge-url x"]
    done = subprocess.run([LCAP, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--judge-url must be an http" in done.stderr and "lcap judge-live did not start" in done.stderr


def test_a_turn_too_long_for_the_judges_context_is_never_sent_and_left_unrewarded_with_the_reason(
    capture_home, tmp_path, fake_llm, judge
):
    """The implicit judge measures each prompt against the judge's context (--judge-context, capped by the
    endpoint's max_model_len, the rule of a judge pass) before it calls: a turn over it is flagged `too_long` with
    the tokens it needs, counted, and never sent; a turn within it is judged as ever."""
    fake_llm.reset()
    judge.context = 1200  # the endpoint's max_model_len, below --judge-context's 8192
    db = tmp_path / "lcap.duckdb"
    rubric = tmp_path / "support.md"
    rubric.write_text("The assistant answers the user's question correctly and helpfully.")
    env = dict(os.environ, LCAP_HOME=str(capture_home), LCAP_DB=str(db), LCAP_NODE_DIR=str(node_cache_dir()))
    env.update(PYTHONUNBUFFERED="1", OPENAI_API_KEY=SECRET)
    proc, port = serve_proxy(env, "--upstream", fake_llm.url)
    proxy = f"http://127.0.0.1:{port}"
    long = "Tell me everything about the history of Spain. " * 80  # ~3,800 characters, each block quotes its share
    try:
        _call(proxy, fake_llm.url, _chat("What is 2+2?", "4", "thanks, that's right"), "s-short")
        _call(proxy, fake_llm.url, _chat(long, long, "no, wrong: " + long), "s-long")
        store = Store(db)
        wait_until(lambda: len(store.fetchall("SELECT * FROM turns")) >= 2, timeout=60)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    args = ["judge-live", f"judge:{rubric}", "--judge-url", judge.url, "--judge-model", "judge-m", "--once"]
    done = subprocess.run(
        [LCAP, *args, "--judge-max-tokens", "50"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "1 turns judged" in done.stdout and "1 failed (flag judge_error, unrewarded, 1 too long" in done.stdout
    assert len(judge.prompts) == 1 and "history of Spain" not in judge.prompts[0]  # the long turn never sent
    rewards = "SELECT e.labels->>'session', r.source FROM rewards r JOIN episodes e USING (episode_id)"
    assert store.fetchall(rewards) == [("s-short", "implicit")]
    ((session, details),) = store.fetchall(
        "SELECT e.labels->>'session', f.details FROM episode_flags f JOIN episodes e USING (episode_id) "
        "WHERE f.flag = 'judge_error'"
    )
    why = json.loads(details)
    assert session == "s-long" and why["too_long"] is True and why["judge_episode"] is None
    assert "too long for the judge's context" in why["error"] and "the judge reads 1200" in why["error"]
    assert store.fetchall("SELECT count(*) FROM episodes WHERE labels->>'role' = 'judge'") == [(1,)]  # one call
