"""`lcap loop --live` and `lcap deploy --rollback` on the real vLLM CPU server, under traffic that never stops.

Agents call the policy through one `lcap proxy --serve` (sessions by header, rewards posted to its endpoint
after each call) for the whole test, while the live loop trains on their rewarded sessions, evaluates the
candidate on held-out tasks and promotes it, `lcap deploy --rollback` restores the base model, and a second
live step's candidate is refused. Every call must succeed and be stored, and the calls after each change
must be served by the deployment it made current."""

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
import pytest
from fixtures_capture import serve_proxy
from stdlib_agent import chat_agent

from lcap.capture.proxy.sessions import session_episode, tenant_of_token
from lcap.policy import read_policy
from lcap.store import Store

pytestmark = pytest.mark.vllm

LCAP = str(Path(sys.executable).parent / "lcap")
KEY = "sk-live-tenant-0123456789"
PROMPTS = ("Which is a number: code seven tool", "Which is a number: list two text")
PAUSE = 0.25  # seconds between an agent's sessions: steady traffic that leaves the loop's training and eval the CPU

# The held-out agent: one call through the loop's own proxy (lcap collect's), its answer on stdout.
AGENT = chat_agent("""
import sys
print(chat([{"role": "user", "content": sys.argv[1]}], max_tokens=8, temperature=1.0, stop=[" "]))
""")
VERIFIER = """
def verify(ctx):
    said = ctx.stdout.strip()
    return sum(c.islower() for c in said) / max(len(said), 1)
"""


class Traffic:
    """Agents calling through the serving proxy until stopped: each session one call, then its reward."""

    def __init__(self, proxy_port: int, rewards_url: str, agents: int = 2) -> None:
        self.proxy = f"http://127.0.0.1:{proxy_port}"
        self.rewards_url = rewards_url
        self.calls: list[dict] = []  # {session, started, model} of each answered call
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.count = iter(range(10**6))
        self.threads = [threading.Thread(target=self._agent, daemon=True) for _ in range(agents)]

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _agent(self) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(proxy=self.proxy, timeout=300) as client:
            while not self.stop.is_set():
                with self.lock:
                    i = next(self.count)
                session = f"live-{i}"
                body = {
                    "model": "gpt-4o-mini",
                    "messages": [{"role": "user", "content": PROMPTS[i % 2]}],
                    "max_tokens": 8,
                    "temperature": 1.0,
                    "stop": [" "],
                }
                started = time.monotonic()
                try:
                    answer = client.post(
                        "http://api.openai.com/v1/chat/completions",
                        json=body,
                        headers={**headers, "X-Lcap-Session": session},
                    )
                    answer.raise_for_status()
                    model = answer.json()["model"]
                    post = {"session": session, "value": float((i // 2) % 2), "source": "test", "key": session}
                    rewarded = httpx.post(self.rewards_url, json=post, headers=headers, timeout=120)
                    assert rewarded.status_code == 201, rewarded.text
                except Exception as exc:  # every failure counts: none is allowed
                    with self.lock:
                        self.failures.append(f"{session}: {exc!r}")
                    continue
                with self.lock:
                    self.calls.append({"session": session, "started": started, "model": model})
                self.stop.wait(PAUSE)

    def served_after(self, since: float, count: int, timeout: float = 120) -> list[str]:
        """The models that answered the first `count` calls started after `since` (monotonic)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                later = [c["model"] for c in self.calls if c["started"] > since]
            if len(later) >= count or time.monotonic() > deadline:
                return later[:count]
            time.sleep(0.2)


def _loop(tmp_path: Path, db: Path, env: dict, rounds: int, margin: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LCAP, "loop", "--live", "--run", str(tmp_path / "run"), "--rounds", str(rounds), "--db", str(db)]
        + ["--min-samples", "4", "--max-staleness", "1", "--promote-margin", str(margin), "--wait-timeout", "240"]
        + ["--eval-tasks", str(tmp_path / "eval.jsonl"), "--eval-group-size", "1", "--timeout", "120"]
        + ["--verifier", f"{tmp_path / 'verify.py'}:verify", "--truncated", "keep", "--lr", "1e-3"]
        + ["--report-to", "none", "--", sys.executable, str(tmp_path / "agent.py"), "{q}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _missing(store: Store, sessions: set[str], said: str) -> str:
    """Where answered sessions missing from the join went: their episode rows, turns and rewards, and the proxy's log."""
    ids = {session_episode(tenant_of_token(KEY), s): s for s in sorted(sessions)[:20]}
    found = {}
    for table in ("episodes", "turns", "rewards"):
        rows = store.fetchall(f"SELECT DISTINCT episode_id FROM {table} WHERE episode_id IN ?", [list(ids)])
        found[table] = sorted(ids[e] for (e,) in rows)
    return f"missing {sorted(sessions)}; of the first 20, stored in {found}\nproxy: {said[-3000:]}"


def test_live_loop_promotes_rolls_back_and_refuses_while_traffic_flows(vllm_policy, tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "verify.py").write_text(VERIFIER)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"id": "held", "q": "Which is a number: one file list"}) + "\n")
    db = tmp_path / "lcap.duckdb"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_BASE_URL", "NO_PROXY", "no_proxy")}
    env.update(LCAP_DB=str(db), OPENAI_API_KEY="sk-eval-not-a-real-key", PYTHONUNBUFFERED="1")
    proc, port = serve_proxy(env, "--upstream", "policy")
    try:
        proxy_record = json.loads((vllm_policy.lcap_home / "proxies" / f"{port}.json").read_text())
        with Traffic(port, proxy_record["rewards_url"]) as traffic:
            first = _loop(tmp_path, db, env, rounds=1, margin=10.0)  # any candidate is no worse by 10
            assert first.returncode == 0, first.stdout + first.stderr[-3000:]
            promoted = read_policy().current
            assert promoted.startswith("policy-r1-") and f"promoted {promoted}" in first.stdout, first.stdout
            assert set(traffic.served_after(time.monotonic() + 1.0, 4)) == {promoted}

            back = subprocess.run(
                [LCAP, "deploy", "--rollback", "--db", str(db)], env=env, capture_output=True, text=True
            )
            assert back.returncode == 0, back.stderr
            assert back.stdout.strip() == f"{vllm_policy.served_model} (rolled back from {promoted})"
            assert set(traffic.served_after(time.monotonic() + 1.0, 4)) == {vllm_policy.served_model}

            second = _loop(tmp_path, db, env, rounds=2, margin=-10.0)  # no candidate gains 10: refused
            assert second.returncode == 0, second.stdout + second.stderr[-3000:]
            assert "step 2:" in second.stdout and "refused: held-out reward" in second.stdout, second.stdout
            assert set(traffic.served_after(time.monotonic() + 1.0, 2)) == {vllm_policy.served_model}
        assert traffic.failures == []
        answered = {c["session"] for c in traffic.calls}
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # its pipes read to the end: a proxy whose log fills a pipe nobody reads would block writing it
            said = proc.communicate(timeout=300)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, said[-3000:]

    store = Store(db)
    stored = store.fetchall(
        "SELECT e.labels->>'session', count(*), any_value(t.status_code) FROM turns t JOIN episodes e USING (episode_id) "
        "WHERE e.labels->>'session' IS NOT NULL GROUP BY 1"
    )
    assert {s for s, _, _ in stored} == answered, _missing(store, answered - {s for s, _, _ in stored}, said)
    assert all(n == 1 and code == 200 for _, n, code in stored), said[-3000:]
    steps = {
        (n, step): json.loads(details)
        for n, step, details in store.fetchall("SELECT round, step, details FROM loop_steps WHERE step = 'promote'")
    }
    assert steps[(1, "promote")]["promoted"] is True and steps[(1, "promote")]["candidate"] == promoted
    refused = steps[(2, "promote")]
    assert refused["promoted"] is False and refused["current"] == vllm_policy.served_model
    assert refused["candidate"] not in read_policy().loras  # dropped from the record, never current
    assert store.fetchall("SELECT name, kind, round, rollback_of FROM deployments ORDER BY created_at") == [
        (promoted, "lora", 1, None),
        (vllm_policy.served_model, "base", None, promoted),
    ]
    assert [r[0] for r in store.fetchall("SELECT round FROM train_runs ORDER BY round")] == [1, 2]
    # Each step trained its own sessions, served within the bound: step 2 after the rollback took the base's and
    # the promoted adapter's calls (one deployment back), and never a session step 1 took.
    taken = store.fetchall(
        "SELECT round, count(*), list(DISTINCT t.deployment ORDER BY t.deployment) FROM episodes e "
        "JOIN turns t USING (episode_id) WHERE split = 'live' GROUP BY round ORDER BY round"
    )
    assert [r[0] for r in taken] == [1, 2] and all(r[1] >= 4 for r in taken)
    assert taken[0][2] == [vllm_policy.served_model]
    evals = store.fetchall(
        "SELECT round, split, list(DISTINCT t.deployment) FROM episode_summary e JOIN turns t USING (episode_id) "
        "WHERE split LIKE 'eval%' GROUP BY ALL ORDER BY ALL"
    )
    assert evals == [
        (1, "eval", [promoted]),
        (1, "eval-current", [vllm_policy.served_model]),
        (2, "eval", [refused["candidate"]]),
    ]
