"""`lcap rescore`: a verifier run again over stored episodes of a real DuckDB store, by the real CLI: what reaches
the verifier, rewards under their own source, failures flagged, bounded parallelism, a crash and its resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from lcap.dataset.collect.rescore import rescore
from lcap.dataset.options import RescoreOptions
from lcap.store import Store

LCAP = str(Path(sys.executable).parent / "lcap")

# A command verifier: logs what it got, then prints its verdict (the file `fail` names an episode it fails on).
VERIFY = r"""
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
transcript = json.load(open(os.environ["LCAP_TRANSCRIPT"]))
episode = os.environ["LCAP_EPISODE_ID"]
running = os.path.join(here, "running")
os.makedirs(running, exist_ok=True)
marker = os.path.join(running, f"{episode}-{os.getpid()}")
open(marker, "w").close()
at_once = len(os.listdir(running))
time.sleep(float(os.environ.get("VERIFY_SLEEP", "0")))
gate, waited = os.environ.get("VERIFY_GATE"), 0
while gate and not os.path.exists(gate) and waited < 2400:
    time.sleep(0.1)
    waited += 1
os.remove(marker)
with open(os.path.join(here, "log.jsonl"), "a") as log:
    log.write(json.dumps({"episode": episode, "at_once": at_once}) + "\n")
if os.path.exists(os.path.join(here, "fail")) and open(os.path.join(here, "fail")).read() == episode:
    print("the judge is down", file=sys.stderr)
    sys.exit(3)
answer = (transcript["messages"] or [{}])[-1].get("content")
print(json.dumps({
    "reward": 1.0 if answer == "Paris" else 0.0,
    "answer": answer,
    "task": json.loads(os.environ["LCAP_TASK"]),
    "files": sorted(os.listdir(".")),
    "stdin": sys.stdin.read(),
    "labels": transcript["labels"],
}))
"""


def _turn(episode_id: str, answer: str) -> dict:
    request = {"model": "m", "messages": [{"role": "user", "content": "The capital of France?"}]}
    return {
        "turn_id": f"{episode_id}/0",
        "episode_id": episode_id,
        "seq": 0,
        "dialect": "chat",
        "status_code": 200,
        "request": json.dumps(request),
        "completion_text": answer,
        "finish_reason": "stop",
        "started_at": datetime.now(UTC),
        "ended_at": datetime.now(UTC),
    }


def _episode(store: Store, episode_id: str, answer: str, *, workdir: Path | None = None, session: bool = False):
    labels = {"session": episode_id, "attributed_by": "header"} if session else {"task": "capital", "collect": "c-1"}
    store.append(
        "episodes",
        [
            {
                "episode_id": episode_id,
                "status": "running" if session else "ok",
                "exit_code": None if session else 0,
                "cwd": str(workdir) if workdir else None,
                "labels": json.dumps(labels),
                "task_id": None if session else "capital",
                "round": None if session else 1,
                "sample": None if session else 0,
                "started_at": datetime.now(UTC),
            }
        ],
    )
    store.append("turns", [_turn(episode_id, answer)])


@pytest.fixture
def verifier(tmp_path) -> tuple[Path, str]:
    folder = tmp_path / "judge"
    folder.mkdir()
    (folder / "verify.py").write_text(VERIFY)
    return folder, f"{sys.executable} {folder / 'verify.py'}"


def _lcap(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([LCAP, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def _rewards(store: Store, source: str) -> dict[str, list]:
    with store.connect(read_only=True) as con:
        rows = con.execute("SELECT episode_id, value, details FROM rewards WHERE source = ?", [source]).fetchall()
    out: dict[str, list] = {}
    for episode, value, details in rows:
        out.setdefault(episode, []).append((value, json.loads(details)))
    return out


def test_the_verifier_gets_the_transcript_task_and_workspace(tmp_path, verifier):
    _, command = verifier
    store = Store(tmp_path / "lcap.duckdb")
    work = tmp_path / "run" / "ep-collect" / "work"
    work.mkdir(parents=True)
    (work / "solution.py").write_text("print('Paris')\n")
    (work.parent / "stdout.txt").write_text("Paris\n")
    _episode(store, "ep-collect", "Paris", workdir=work)
    _episode(store, "ep-live", "Lyon", session=True)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "capital", "answer": "Paris"}) + "\n")

    done = _lcap("rescore", "--db", str(store.path), "--verifier", command, "--where", "true", "--source", "judge-v2",
                 "--tasks", str(tasks))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 episodes chosen, 0 scored before (skipped), 2 scored, 0 failed" in done.stdout
    got = _rewards(store, "judge-v2")
    (collect,), (live,) = got["ep-collect"], got["ep-live"]
    assert collect[0] == 1.0 and collect[1]["answer"] == "Paris"
    assert collect[1]["files"] == ["solution.py"] and collect[1]["stdin"] == "Paris\n"  # its kept workspace, stdout
    assert collect[1]["task"] == {"id": "capital", "answer": "Paris"}
    assert live[0] == 0.0 and live[1]["answer"] == "Lyon" and live[1]["files"] == []  # an empty folder of its own
    assert live[1]["labels"]["attributed_by"] == "header"
    with store.connect(read_only=True) as con:  # build-dataset --reward-source reads them
        assert con.execute("SELECT count(*) FROM rewards_from('judge-v2')").fetchone() == (2,)


def test_a_python_verifier_gets_the_transcript_in_its_context(tmp_path):
    store = Store(tmp_path / "lcap.duckdb")
    _episode(store, "ep-live", "Paris", session=True)
    (tmp_path / "judge.py").write_text(
        "def judge(ctx):\n"
        "    return {'reward': 0.5, 'said': ctx.transcript['messages'][-1]['content'], 'task': dict(ctx.task)}\n"
    )
    result = rescore(store, RescoreOptions(verifier="judge.py:judge", where="true", source="py"), base=tmp_path)
    assert result.scored == 1
    assert _rewards(store, "py") == {"ep-live": [(0.5, {"said": "Paris", "task": {"id": None}})]}


def test_failures_are_flagged_tampered_get_zero_and_a_rerun_scores_only_the_rest(tmp_path, verifier):
    folder, command = verifier
    store = Store(tmp_path / "lcap.duckdb")
    for name in ("a", "b", "c"):
        _episode(store, name, "Paris", session=True)
    store.flag_episode("c", "tampered", {"tampered": ["test_x.py"]})
    (folder / "fail").write_text("b")

    first = _lcap("rescore", "--db", str(store.path), "--verifier", command, "--where", "true", "--source", "s")
    assert first.returncode == 1
    assert "lcap: rescore: b: verifier exited 3: the judge is down" in first.stderr
    assert "1 failed (flag rescore_error), 1 tampered (reward 0)" in first.stdout
    with store.connect(read_only=True) as con:
        ((flag,),) = con.execute("SELECT details FROM episode_flags WHERE flag = 'rescore_error'").fetchall()
    flag = json.loads(flag)
    assert flag["source"] == "s" and "the judge is down" in flag["output"]
    assert {e: [v for v, _ in r] for e, r in _rewards(store, "s").items()} == {"a": [1.0], "c": [0.0]}
    logged = [json.loads(line)["episode"] for line in (folder / "log.jsonl").read_text().splitlines()]
    assert sorted(logged) == ["a", "b"]  # the tampered episode was never handed to the verifier

    (folder / "fail").unlink()
    second = _lcap("rescore", "--db", str(store.path), "--verifier", command, "--where", "true", "--source", "s")
    assert second.returncode == 0, second.stderr
    assert "3 episodes chosen, 2 scored before (skipped), 1 scored, 0 failed" in second.stdout
    assert {e: len(r) for e, r in _rewards(store, "s").items()} == {"a": 1, "b": 1, "c": 1}


def test_a_bad_where_is_one_line(tmp_path, verifier):
    store = Store(tmp_path / "lcap.duckdb")
    _episode(store, "a", "Paris", session=True)
    done = _lcap("rescore", "--db", str(store.path), "--verifier", verifier[1], "--where", "rewardd > 0")
    assert done.returncode == 2 and done.stderr.startswith("lcap: bad --where: ")
    assert len(done.stderr.strip().splitlines()) == 1
    dropped = _lcap("rescore", "--db", str(store.path), "--verifier", verifier[1], "--where", "true; DROP TABLE turns")
    assert dropped.returncode == 2 and "lcap: bad --where:" in dropped.stderr
    assert not (verifier[0] / "log.jsonl").exists()


def test_parallelism_is_bounded_and_used(tmp_path, verifier):
    folder, command = verifier
    store = Store(tmp_path / "lcap.duckdb")
    for n in range(6):
        _episode(store, f"e{n}", "Paris", session=True)
    done = _lcap("rescore", "--db", str(store.path), "--verifier", command, "--where", "true", "-j", "2",
                 env={"VERIFY_SLEEP": "0.5"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    at_once = [json.loads(line)["at_once"] for line in (folder / "log.jsonl").read_text().splitlines()]
    assert len(at_once) == 6 and max(at_once) == 2


def test_a_killed_rescore_resumes_and_scores_no_episode_twice(tmp_path, verifier):
    _, command = verifier
    store = Store(tmp_path / "lcap.duckdb")
    episodes = [f"e{n:02d}" for n in range(16)]
    for name in episodes:
        _episode(store, name, "Paris", session=True)
    args = [LCAP, "rescore", "--db", str(store.path), "--verifier", command, "--where", "true", "-j", "2"]
    proc = subprocess.Popen(args, env={**os.environ, "VERIFY_SLEEP": "0.4"}, stdout=subprocess.PIPE, text=True)
    source = f"rescore:{command}"
    try:
        deadline = time.monotonic() + 120
        while not _rewards(store, source) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, "rescore ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    stored = _rewards(store, source)
    assert 0 < len(stored) < len(episodes)
    done = _lcap(*args[1:])
    assert done.returncode == 0, done.stderr
    assert f"16 episodes chosen, {len(stored)} scored before (skipped), {16 - len(stored)} scored" in done.stdout
    assert {e: len(r) for e, r in _rewards(store, source).items()} == dict.fromkeys(episodes, 1)


def test_two_rescores_of_one_source_at_once_store_each_reward_once(tmp_path, verifier):
    """Both processes score every episode (each verifier waits until all eight run): only the key keeps the second
    verdict of an episode out."""
    folder, command = verifier
    store = Store(tmp_path / "lcap.duckdb")
    for n in range(4):
        _episode(store, f"e{n}", "Paris", session=True)
    args = [LCAP, "rescore", "--db", str(store.path), "--verifier", command, "--where", "true", "--source", "twice"]
    env = {**os.environ, "VERIFY_GATE": str(tmp_path / "go")}
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(list((folder / "running").glob("e*"))) < 8:
            time.sleep(0.2)
        assert len(list((folder / "running").glob("e*"))) == 8
    finally:
        (tmp_path / "go").touch()
    for proc in procs:
        assert proc.wait(timeout=240) == 0
    assert {e: len(r) for e, r in _rewards(store, "twice").items()} == {f"e{n}": 1 for n in range(4)}


# A verifier that leaves a daemon behind: a child in a session of its own (out of the verifier's process group)
# that ignores SIGTERM, its pid in `daemon.pid`; then it prints its verdict, or with `hang` never does.
DETACH = r"""
import os, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
daemon = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
    start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
open(os.path.join(here, f"daemon-{os.environ['LCAP_EPISODE_ID']}.pid"), "w").write(str(daemon.pid))
if os.environ["LCAP_EPISODE_ID"] == "ep-hang":
    time.sleep(600)
print(1.0)
"""


def test_what_a_verifier_started_ends_with_it_or_at_its_timeout_even_out_of_its_group(tmp_path):
    """A rescore verifier's detached child (setsid, SIGTERM ignored) is gone when rescore returns: after a verifier
    that ended, and after one killed at its timeout (issue 48 row 7: it outlived rescore)."""
    store = Store(tmp_path / "lcap.duckdb")
    _episode(store, "ep-done", "Paris")
    _episode(store, "ep-hang", "Paris")
    (tmp_path / "detach.py").write_text(DETACH)
    verifier = f"{sys.executable} {tmp_path / 'detach.py'}"
    options = RescoreOptions(verifier=verifier, where="true", timeout=10, concurrency=2)
    result = rescore(store, options)
    assert (result.scored, result.failed) == (1, 1)
    for episode in ("ep-done", "ep-hang"):
        pid = int((tmp_path / f"daemon-{episode}.pid").read_text())
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(pid), f"{episode}'s verifier left process {pid} running"


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
