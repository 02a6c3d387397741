"""`lcap collect` runner without a model: statuses and reasons, timeouts killing the process group,
verifier errors, the tamper guard, resume after an interrupted run. Real subprocesses, a real
capture proxy (pass-through: these agents make no LLM call) and a real DuckDB file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lcap.dataset.collect.episodes import collect_episodes
from lcap.dataset.options import CollectOptions
from lcap.store import Store

AGENT = """
import json, os, subprocess, sys, time
task = json.loads(os.environ["LCAP_TASK"])
print("agent", os.environ["LCAP_EPISODE_ID"], os.getcwd(), "proxy" if os.environ.get("HTTPS_PROXY") else "no-proxy")
mode = sys.argv[1]
if mode == "fail":
    print("something broke", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    child = subprocess.Popen(["sleep", "120"])  # a grandchild: the whole group must die on timeout
    open(os.environ["PIDFILE"], "w").write(str(child.pid))
    time.sleep(120)
if mode == "cheat":
    open("tests/test_task.py", "w").write("def test_ok(): pass\\n")
if mode == "gate" and os.path.exists(os.environ["GATE"]) and task["id"] == "t2":
    time.sleep(120)
open("answer.txt", "w").write(task.get("answer", mode))
"""

VERIFIER = """
def judge(ctx):
    text = (ctx.workdir / "answer.txt").read_text()
    if text == "crash":
        raise ValueError("cannot judge " + text)
    return {"reward": float(len(text) % 3), "text": text}

judge.protected = ["tests/**"]
"""


@pytest.fixture
def collect_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIDFILE", str(tmp_path / "grandchild.pid"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "judge.py").write_text(VERIFIER)
    return tmp_path


def _tasks(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for init to reap it."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _summary(store: Store) -> dict[str, tuple]:
    rows = store.fetchall(
        "SELECT episode_id, task_id, sample, status, error, reward, reward_source, flags "
        "FROM episode_summary ORDER BY episode_id"
    )
    return {(r[1], r[2]): r for r in rows}


def test_collect_records_every_outcome(collect_env):
    tmp = collect_env
    tasks = _tasks(
        tmp / "tasks.jsonl",
        [
            {"id": "ok", "mode": "ok", "answer": "abcd"},
            {"id": "fail", "mode": "fail"},
            {"id": "hang", "mode": "hang"},
            {"id": "crash", "mode": "ok", "answer": "crash"},
            {"id": "cheat", "mode": "cheat", "files": {"tests/test_task.py": "def test_ok(): assert False\n"}},
            {"id": "setup", "mode": "ok", "template": "no-such-dir"},
        ],
    )
    store = Store(tmp / "lcap.duckdb")
    started = time.monotonic()
    options = CollectOptions(group_size=2, concurrency=4, round=3, verifier="judge.py:judge", upstream=None, timeout=10)
    result = collect_episodes(
        store, tasks=tasks, command=[sys.executable, "agent.py", "{mode}"], options=options, labels={"exp": "unit"}
    )
    assert time.monotonic() - started < 120  # under the hung agent's own sleep: it ended at its timeout
    assert (result.episodes, result.finished, result.failed, result.skipped) == (12, 4, 8, 0)
    assert result.statuses == {"ok": 4, "failed": 2, "timeout": 2, "error": 4} and result.tampered == 2
    assert result.mean_reward == pytest.approx(0.5)  # 1.0, 1.0 (len 4 % 3) and 0.0, 0.0 (tampered)

    rows = _summary(store)
    assert len(rows) == 12
    setup = rows[("setup", 0)]
    assert setup[3] == "error" and "no-such-dir is not a directory" in setup[4]
    ok = rows[("ok", 0)]
    assert ok[3:7] == ("ok", None, 1.0, "judge.py:judge")
    fail = rows[("fail", 1)]
    assert fail[3] == "failed" and "agent exited 3: something broke" in fail[4] and fail[5] is None
    hang = rows[("hang", 0)]
    assert hang[3] == "timeout" and hang[4] == "timed out after 10s"
    crash = rows[("crash", 0)]
    assert crash[3] == "error" and "ValueError: cannot judge crash" in crash[4] and crash[7] == ["verifier_error"]
    cheat = rows[("cheat", 1)]
    assert cheat[3:8] == ("ok", None, 0.0, "tamper-guard", ["tampered"])
    (details,) = store.fetchall(
        "SELECT details FROM episode_flags WHERE episode_id = ? AND flag = 'tampered'", [cheat[0]]
    )
    assert json.loads(details[0])["tampered"] == ["tests/test_task.py"]

    # the grandchild of the timed-out agent was killed with its process group
    pid = int((tmp / "grandchild.pid").read_text())
    assert _dead(pid)

    # labels, group, command and the per-episode working directory
    (labels, command, cwd) = store.fetchall("SELECT labels, command, cwd FROM episodes WHERE episode_id = ?", [ok[0]])[
        0
    ]
    labels = json.loads(labels)
    assert labels["exp"] == "unit" and labels["collect"] == result.run_id
    assert command.endswith("agent.py ok") and cwd.endswith(f"{ok[0]}/work")
    out = (Path(cwd).parent / "stdout.txt").read_text()
    assert out.startswith(f"agent {ok[0]} {cwd} proxy")


def test_verify_failed_verifies_an_agent_that_exits_non_zero(collect_env):
    """--verify-failed: a non-zero exit is an outcome the verifier scores (it sees the exit code), not a failure."""
    tmp = collect_env
    (tmp / "exits.py").write_text("def judge(ctx):\n    return {'reward': 0.0 if ctx.exit_code else 1.0}\n")
    tasks = _tasks(tmp / "tasks.jsonl", [{"id": "fail", "mode": "fail"}, {"id": "ok", "mode": "ok"}])
    store = Store(tmp / "lcap.duckdb")
    options = CollectOptions(group_size=1, concurrency=2, verifier="exits.py:judge", upstream=None, verify_failed=True)
    result = collect_episodes(store, tasks=tasks, command=[sys.executable, "agent.py", "{mode}"], options=options)
    assert result.statuses == {"ok": 2}
    rows = _summary(store)
    assert rows[("fail", 0)][3:6] == ("ok", None, 0.0) and rows[("ok", 0)][3:6] == ("ok", None, 1.0)
    assert store.fetchall("SELECT exit_code FROM episodes WHERE episode_id = ?", [rows[("fail", 0)][0]]) == [(3,)]


def test_verifiers_are_told_the_episodes_sample(collect_env):
    """A verifier function's `ctx.sample` and a verifier command's LCAP_SAMPLE are the episode's place in its group
    (its `sample` label): what a test verifier steps rewards by, without parsing episode ids."""
    tmp = collect_env
    (tmp / "by_sample.py").write_text("def judge(ctx):\n    return {'reward': float(ctx.sample)}\n")
    (tmp / "by_sample.sh").write_text('echo "$LCAP_SAMPLE"\n')
    tasks = _tasks(tmp / "tasks.jsonl", [{"id": "t", "mode": "ok"}])
    agent = [sys.executable, "agent.py", "{mode}"]
    for verifier, split in (("by_sample.py:judge", "train"), ("sh by_sample.sh", "eval")):
        store = Store(tmp / "lcap.duckdb")
        options = CollectOptions(group_size=3, concurrency=3, verifier=verifier, upstream=None, split=split)
        assert collect_episodes(store, tasks=tasks, command=agent, options=options, progress=False).statuses == {
            "ok": 3
        }
        rows = store.fetchall("SELECT sample, reward FROM episode_summary WHERE split = ? ORDER BY 1", [split])
        assert rows == [(0, 0.0), (1, 1.0), (2, 2.0)], verifier


def test_resume_after_interrupted_run(collect_env):
    tmp = collect_env
    tasks = _tasks(tmp / "tasks.jsonl", [{"id": f"t{i}", "mode": "gate"} for i in range(3)])
    gate = tmp / "gate"
    gate.write_text("")
    lcap = str(Path(sys.executable).parent / "lcap")
    argv = [
        lcap,
        "collect",
        "--tasks",
        str(tasks),
        "--db",
        str(tmp / "lcap.duckdb"),
        "-g",
        "2",
        "-j",
        "6",
        "--round",
        "1",
        "--upstream",
        "none",
        "--verifier",
        "judge.py:judge",
        "--",
        sys.executable,
        "agent.py",
        "{mode}",
    ]
    env = {**os.environ, "GATE": str(gate)}
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = Store(tmp / "lcap.duckdb")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the four quick episodes finish (the store is shared per transaction)
        if (tmp / "lcap.duckdb").exists() and store.fetchall("SELECT count(*) FROM episodes WHERE status = 'ok'")[0][
            0
        ] == 4:
            break
        time.sleep(0.3)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=180)  # a loaded machine: interrupting 6 agents and the writer
    assert first.returncode == 130, err
    assert "interrupted; finished episodes are kept" in err

    before = {r[0]: r for r in store.fetchall("SELECT episode_id, status, started_at, task_id FROM episodes")}
    assert sorted(r[1] for r in before.values()) == ["interrupted", "interrupted", "ok", "ok", "ok", "ok"]
    assert {r[3] for r in before.values() if r[1] == "interrupted"} == {"t2"}

    gate.unlink()
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "6 episodes, 2 ok, 0 failed, 4 skipped (already done)" in second.stdout
    after = {r[0]: r for r in store.fetchall("SELECT episode_id, status, started_at, task_id FROM episodes")}
    assert sorted(after) == sorted(before) and {r[1] for r in after.values()} == {"ok"}
    for eid, row in before.items():
        if row[1] == "ok":
            assert after[eid][2] == row[2]  # finished episodes were not run again
    assert store.fetchall("SELECT count(*) FROM latest_rewards")[0][0] == 6

    third = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert "0 ok, 0 failed, 6 skipped" in third.stdout


def test_collect_bad_input_is_one_line(collect_env):
    lcap = str(Path(sys.executable).parent / "lcap")
    bad = _tasks(collect_env / "bad.jsonl", [{"id": "a"}])
    run = subprocess.run(
        [
            lcap,
            "collect",
            "--tasks",
            str(bad),
            "--db",
            str(collect_env / "x.duckdb"),
            "--upstream",
            "none",
            "--",
            "echo",
            "{question}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert (
        run.stderr.strip() == "lcap: placeholder {question} in the command is not a task field (fields: cwd, "
        "episode_id, id, round, sample, split, workdir)"
    )


def test_episode_ids_are_not_guessable(collect_env):
    """The same collect into two stores: the same labels, ids that differ in a random part (#33 row 3)."""
    tasks = _tasks(collect_env / "tasks.jsonl", [{"id": "t1", "mode": "ok"}])
    options = CollectOptions(group_size=2, concurrency=2, upstream=None, timeout=30)
    ids = []
    for name in ("a", "b"):
        store = Store(collect_env / f"{name}.duckdb")
        collect_episodes(
            store, tasks=tasks, command=[sys.executable, "agent.py", "ok"], options=options, progress=False
        )
        ids.append({r[0]: r[1] for r in store.fetchall("SELECT sample, episode_id FROM episodes")})
    assert sorted(ids[0]) == sorted(ids[1]) == [0, 1]
    for sample in (0, 1):
        assert ids[0][sample] != ids[1][sample]
        assert ids[0][sample].rsplit("-", 1)[0] == ids[1][sample].rsplit("-", 1)[0]
