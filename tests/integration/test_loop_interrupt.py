"""A running `lcap loop`: `lcap status` finds its store though the loop was given --db, and Ctrl-C ends it with one
line saying where it stopped and how to resume, exit 130 (as `lcap collect`).

A real `lcap loop` subprocess and its collects; the policy server is only a record (the agent, `sleep`, never
calls it: no vLLM is needed to watch and stop a loop in its first rounds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lcap.policy import PolicyServer
from lcap.store import Store


def test_status_finds_a_running_loop_and_ctrl_c_says_where_it_stopped(tmp_path, policy_stand_in):
    home = tmp_path / "home"
    home.mkdir()
    record = PolicyServer(policy_stand_in, None, "/m", "m", "m", "/tmp/vllm.log", "python", "2026-01-01")
    (home / "policy.json").write_text(json.dumps(asdict(record)))
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t0", "secs": 120}) + "\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"id": "e0", "secs": 0}) + "\n")
    db, run = tmp_path / "lcap.duckdb", tmp_path / "run"
    lcap = str(Path(sys.executable).parent / "lcap")
    argv = [lcap, "loop", "--db", str(db), "--run", str(run), "--rounds", "2", "--tasks", str(tmp_path / "tasks.jsonl")]
    argv += ["--eval-tasks", str(tmp_path / "eval.jsonl"), "--group-size", "2", "--", "sleep", "{secs}"]
    env = {**os.environ, "LCAP_HOME": str(home), "LCAP_POLICY_RECORD": str(home / "policy.json")}
    loop = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and loop.poll() is None:  # held-out done, round 1's collect runs
        if db.exists() and Store(db).fetchall("SELECT count(*) FROM episodes WHERE status = 'running'")[0][0]:
            break
        time.sleep(0.3)
    assert loop.poll() is None, loop.communicate()

    elsewhere = tmp_path / "elsewhere"  # no --db: its default store (./lcap.duckdb) has no loop step
    elsewhere.mkdir()
    status = subprocess.run([lcap, "status", "--json"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    (found,) = json.loads(status.stdout)["loop"]
    assert (found["run"], found["round"], found["step"]) == (str(run.resolve()), 0, "eval")

    loop.send_signal(signal.SIGINT)
    out, err = loop.communicate(timeout=180)
    assert loop.returncode == 130, out + err
    assert err.strip().splitlines()[-1] == (
        f"lcap loop: interrupted after round 0's eval; finished steps are kept in {run / 'state.json'}, "
        "re-run the same command to resume"
    )
    statuses = Store(db).fetchall("SELECT split, status FROM episodes ORDER BY split, sample")
    assert statuses == [("eval", "ok"), ("train", "interrupted"), ("train", "interrupted")]
    assert not list((home / "loops").glob("*.json"))  # the loop's record is gone with it
