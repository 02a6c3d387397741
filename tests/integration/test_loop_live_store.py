"""`lcap loop --live`'s choice of episodes and `lcap deploy --rollback` on a real DuckDB store and policy record,
without a server: which live episodes a step takes (rewarded, fresh, in a trainable group), that adopting them
makes them a round build-dataset reads, and which deployment each rollback restores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures_capture import wait_until

from lcap.dataset.build.builder import build_dataset
from lcap.dataset.options import BuildOptions
from lcap.loop.live import LIVE_SPLIT, adopt, ready_episodes
from lcap.policy import PolicyServer, read_policy, write_policy
from lcap.store import Store, now

LCAP = str(Path(sys.executable).parent / "lcap")


def _live(builder, episode: str, prompt: list[int], reward: float | None, deployment: str = "base", **labels) -> None:
    """A session a serving proxy opened (no round, no task, still running) with one call, and its reward."""
    store = builder.store
    row = {"episode_id": episode, "status": "running", "started_at": builder._tick()}
    store.append("episodes", [{**row, "labels": json.dumps({"attributed_by": "header", **labels})}])
    turn = {"turn_id": f"{episode}/0", "episode_id": episode, "seq": 0, "dialect": "chat", "status_code": 200}
    ids = {"prompt_token_ids": prompt, "completion_token_ids": [7, 8, 9], "completion_logprobs": [-0.5] * 3}
    times = {"started_at": builder._tick(), "ended_at": builder._tick()}
    store.append("turns", [{**turn, **ids, **times, "deployment": deployment, "token_source": "vllm"}])
    if reward is not None:
        builder.reward(episode, reward)


def test_a_step_takes_rewarded_fresh_episodes_of_trainable_groups_and_adopts_them(builder, dstore, tmp_path):
    a, b, c = [1, 2, 3], [1, 2, 4], [1, 2, 5]
    _live(builder, "s-a1", a, 1.0)
    _live(builder, "s-a2", a, 0.0, deployment="r1")
    _live(builder, "s-a3", a, 1.0)
    _live(builder, "s-a4", a, None)  # no reward yet
    _live(builder, "s-a5", a, 0.0, deployment="old")  # served by a deployment past the bound
    _live(builder, "s-b1", b, 1.0)  # its group's rewards are equal: no GRPO signal
    _live(builder, "s-b2", b, 1.0)
    _live(builder, "s-c1", c, 1.0)  # alone in its group
    builder.episode(
        "collected", task="t", round=3, reward=1.0, turns=[{"prompt_token_ids": a, "completion_token_ids": [7]}]
    )

    ready = ready_episodes(dstore, ["base", "r1"])
    assert [r[0] for r in ready] == ["s-a1", "s-a2", "s-a3"]
    assert len({r[2] for r in ready}) == 1 and [r[3] for r in ready] == ["base", "r1", "base"]
    assert {r[0] for r in ready_episodes(dstore, ["base", "r1"], keep_zero_variance=True)} == {
        "s-a1",
        "s-a2",
        "s-a3",
        "s-b1",
        "s-b2",
    }

    # A baseline over the batch needs no repeated prompt: every rewarded, fresh session is ready.
    assert {r[0] for r in ready_episodes(dstore, ["base", "r1"], advantage="batch")} == {
        "s-a1",
        "s-a2",
        "s-a3",
        "s-b1",
        "s-b2",
        "s-c1",
    }
    builder.reward("s-c1", 0.5, source="judge")
    assert [r[:2] for r in ready_episodes(dstore, ["base", "r1"], advantage="rloo", reward_source="judge")] == [
        ("s-c1", 0.5)
    ]

    batch = [{"id": r[0], "group": r[2], "sample": i, "ended_at": str(r[4])} for i, r in enumerate(ready)]
    adopt(dstore, tmp_path / "run", 1, batch)
    adopt(dstore, tmp_path / "run", 1, batch)  # a resumed step adopts again: the same rows
    assert ready_episodes(dstore, ["base", "r1"]) == []  # taken once
    rows = dstore.fetchall(
        "SELECT episode_id, round, split, sample, status, ended_at IS NOT NULL, labels->>'session' IS NULL "
        "FROM episodes WHERE episode_id LIKE 's-a%' ORDER BY 1"
    )
    assert rows[:3] == [(f"s-a{i + 1}", 1, LIVE_SPLIT, i, "ok", True, True) for i in range(3)]
    assert [r[1] for r in rows[3:]] == [None, None]

    report = build_dataset(dstore, round=1, out=tmp_path / "data", options=BuildOptions(split=LIVE_SPLIT))
    samples = pq.read_table(tmp_path / "data" / "samples.parquet").to_pylist()
    assert report.samples == 3 and sorted(s["episode_id"] for s in samples) == ["s-a1", "s-a2", "s-a3"]
    assert sorted(round(s["advantage"], 3) for s in samples) == [-1.155, 0.577, 0.577]  # (r - 2/3) / std
    assert {s["deployment"] for s in samples} == {"base", "r1"}


@pytest.fixture
def record(tmp_path, monkeypatch) -> Path:
    """A policy record serving the base `tiny` and two adapters (on a closed port: a rollback to what the
    replicas serve already only rewrites the record), and a store that saw them deployed."""
    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    loras = {"policy-r1-aa": str(tmp_path / "r1"), "policy-r2-bb": str(tmp_path / "r2")}
    server = PolicyServer(
        url="http://127.0.0.1:9", pid=None, base_model=str(tmp_path / "tiny"), served_model="tiny",
        current="policy-r2-bb", log_path="", python="", started_at="", loras=loras,
    )  # fmt: skip
    write_policy(server)
    store = Store(tmp_path / "lcap.duckdb")
    for name, path, kind, round_ in [
        ("tiny", str(tmp_path / "tiny"), "base", None),
        ("policy-r1-aa", loras["policy-r1-aa"], "lora", 1),
        ("policy-r2-bb", loras["policy-r2-bb"], "lora", 2),
    ]:
        row = {"name": name, "path": path, "base_model": str(tmp_path / "tiny"), "kind": kind, "round": round_}
        store.append("deployments", [{**row, "created_at": now()}])
    return tmp_path / "lcap.duckdb"


def _rollback(db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LCAP, "deploy", "--rollback", *args, "--db", str(db)], capture_output=True, text=True, env=dict(os.environ)
    )


def test_rollback_restores_the_deployment_before_then_walks_back_and_records_each(record):
    done = _rollback(record)
    assert done.returncode == 0 and done.stdout.strip() == "policy-r1-aa (rolled back from policy-r2-bb)", done.stderr
    assert read_policy().current == "policy-r1-aa"
    done = _rollback(record)  # policy-r1-aa was first deployed after the base: a second rollback goes there
    assert done.returncode == 0 and read_policy().current == "tiny", done.stderr
    done = _rollback(record)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "lcap: no deployment before 'tiny' in this store: it has policy-r2-bb, policy-r1-aa, tiny "
        '(`lcap sql "SELECT * FROM deployments"`)'
    ]
    assert _rollback(record, "--round", "2").returncode == 0 and read_policy().current == "policy-r2-bb"
    assert _rollback(record, "policy-r1-aa").returncode == 0 and read_policy().current == "policy-r1-aa"
    rows = Store(record).fetchall(
        "SELECT name, kind, round, rollback_of FROM deployments WHERE rollback_of IS NOT NULL ORDER BY created_at"
    )
    assert rows == [
        ("policy-r1-aa", "lora", 1, "policy-r2-bb"),
        ("tiny", "base", None, "policy-r1-aa"),
        ("policy-r2-bb", "lora", 2, "tiny"),
        ("policy-r1-aa", "lora", 1, "policy-r2-bb"),
    ]


def test_rollback_to_an_unknown_or_current_deployment_is_one_line(record):
    unknown = _rollback(record, "policy-r9-zz")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert unknown.stderr.startswith("lcap: no deployment 'policy-r9-zz' in this store: it has policy-r2-bb")
    assert _rollback(record, "--round", "7").stderr.startswith("lcap: no deployment of round 7 in this store")
    same = _rollback(record, "policy-r2-bb")
    assert same.returncode == 2 and "is the current deployment already" in same.stderr
    assert read_policy().current == "policy-r2-bb"
    assert Store(record).fetchall("SELECT count(*) FROM deployments WHERE rollback_of IS NOT NULL") == [(0,)]


def test_a_reward_posted_before_its_episode_row_is_stored_waits_for_it(tmp_path, monkeypatch):
    """The serving proxy stores a session's row from a thread of its own; a reward posted before it lands looks
    again once the rows in flight are stored (`settle`), instead of a 404 (seen under load in the live e2e test)."""
    import httpx

    from lcap.capture.proxy.rewards_api import RewardEndpoint
    from lcap.capture.proxy.sessions import session_episode, tenant_of_token

    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    store = Store(tmp_path / "lcap.duckdb")
    tenant = tenant_of_token("sk-tenant")
    store.append("episodes", [{"episode_id": "other", "labels": json.dumps({"tenant": tenant})}])
    episode = session_episode(tenant, "late-row")
    arrived = []

    def settle() -> None:  # the row the proxy's writer thread had in its queue
        arrived.append(episode)
        store.append(
            "episodes", [{"episode_id": episode, "labels": json.dumps({"tenant": tenant})}], new_by="episode_id"
        )

    endpoint = RewardEndpoint(store, "proxy-token", settle=settle)
    endpoint.start()
    try:
        post = {"session": "late-row", "value": 1.0, "key": "k1"}
        answer = httpx.post(endpoint.url, json=post, headers={"Authorization": "Bearer sk-tenant"}, timeout=60)
        assert answer.status_code == 201 and answer.json()["episode_id"] == episode, answer.text
        unknown = httpx.post(
            endpoint.url, json={**post, "session": "never"}, headers={"Authorization": "Bearer sk-tenant"}, timeout=60
        )
        assert unknown.status_code == 404  # still unknown after the rows in flight: refused as before
    finally:
        endpoint.stop()
    assert arrived == [episode, episode] and store.fetchall("SELECT episode_id FROM rewards") == [(episode,)]


def test_rewards_waiting_on_a_held_store_share_one_attach_and_need_no_episode_row(tmp_path, monkeypatch):
    """Posts that arrive while another unit of work holds the store file are stored together once it is free, in one
    attach, and a session the proxy opened is placed from memory, its row not stored yet (each post attaching the
    store two or three times, settle included, queued behind every writer batch: ~14 s a post in the live sim)."""
    import threading

    import httpx

    from lcap.capture.proxy.rewards_api import KnownEpisodes, RewardEndpoint
    from lcap.capture.proxy.sessions import session_episode, tenant_of_token

    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    store = Store(tmp_path / "lcap.duckdb")
    tenant = tenant_of_token("sk-tenant")
    known, posts = KnownEpisodes(), 8
    for k in range(posts):
        known.add(session_episode(tenant, f"s{k}"), {"tenant": tenant, "session": f"s{k}"})
    attaches: list[str] = []
    attach = Store._attach

    def counted(self, con, read_only):
        attaches.append(threading.current_thread().name)
        return attach(self, con, read_only)

    monkeypatch.setattr(Store, "_attach", counted)
    settled: list[int] = []
    endpoint = RewardEndpoint(store, "proxy-token", known=known, settle=lambda: settled.append(1))
    endpoint.start()
    answers: list[httpx.Response] = []

    def post(k: int) -> None:
        body = {"session": f"s{k}", "value": 1.0, "key": f"k{k}"}
        answers.append(httpx.post(endpoint.url, json=body, headers={"Authorization": "Bearer sk-tenant"}, timeout=120))

    try:
        with store.connect():  # held, as a writer's batch or the loop's build holds it
            threads = [threading.Thread(target=post, args=(k,)) for k in range(posts)]
            for thread in threads:
                thread.start()
            wait_until(lambda: endpoint.pending == posts, timeout=60)
        for thread in threads:
            thread.join(120)
    finally:
        endpoint.stop()
    assert sorted(a.status_code for a in answers) == [201] * posts, [a.text for a in answers]
    rewards_attaches = attaches.count("lcap-rewards")
    assert rewards_attaches <= 2, rewards_attaches  # the first post alone at most, then the rest together
    assert settled == []
    stored = store.fetchall("SELECT count(*), count(DISTINCT episode_id) FROM rewards")
    assert stored == [(posts, posts)]
