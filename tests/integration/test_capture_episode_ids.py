"""An episode id names one episode: `lcap episode new --id` and `lcap proxy --episode` refuse one the store holds,
and leave that episode as it was (its status, task and round: a reset would take it out of its group)."""

from __future__ import annotations

import json
import signal
import sys

from fixtures_capture import run_lcap, serve_proxy

from lcap.store import Store


def episode_row(db: str, episode_id: str) -> tuple:
    return Store(db).fetchall("SELECT status, task_id, round, labels FROM episodes WHERE episode_id = ?", [episode_id])


def test_episode_new_refuses_an_id_the_store_holds(capture_env, llm):
    proc, port = serve_proxy(capture_env, "--upstream", llm.url)
    try:
        first = run_lcap(
            ["episode", "new", "--port", str(port), "--id", "ep-1", "--label", "task=7", "--label", "round=2"],
            capture_env,
        )
        assert first.returncode == 0, first.stderr
        again = run_lcap(["episode", "new", "--port", str(port), "--id", "ep-1", "--json"], capture_env)
        assert again.returncode != 0 and again.stdout == ""
        assert "episode 'ep-1' exists already (status running)" in again.stderr
        assert len(again.stderr.strip().splitlines()) == 1
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    (row,) = episode_row(capture_env["LCAP_DB"], "ep-1")
    assert row[:3] == ("running", "7", 2)
    assert json.loads(row[3]) == {"task": "7", "round": "2"}


def test_proxy_refuses_to_run_an_agent_into_a_finished_episode(capture_env, llm, tmp_path):
    marker = tmp_path / "ran"
    agent = [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x')"]
    args = ["proxy", "--upstream", llm.url, "--episode", "ep-2", "--label", "task=3", "--label", "round=1", "--"]
    done = run_lcap([*args, *agent], capture_env)
    assert done.returncode == 0, done.stderr
    again = run_lcap(["proxy", "--upstream", llm.url, "--episode", "ep-2", "--", *agent], capture_env)
    assert again.returncode != 0
    assert "episode 'ep-2' exists already (status ok)" in again.stderr
    assert marker.read_text() == "x"  # the agent did not run a second time
    (row,) = episode_row(capture_env["LCAP_DB"], "ep-2")
    assert row[:3] == ("ok", "3", 1)
