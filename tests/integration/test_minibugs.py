"""The minibugs task set end to end: its workspaces run under `python -m unittest` and `python -m pytest`, and its
verifier (scripts/tasks/minibugs/verify.py) rewards episodes of `lcap collect` run by a scripted agent that fixes
the bug, leaves it, edits the tests, adds tests of its own or hangs the test run; called directly, it puts back
tests the agent changed and does not count a skipped test as a pass."""

from __future__ import annotations

import ast
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lcap.dataset.collect.verifiers import VerifierContext, load_verifier
from lcap.store import Store

MINIBUGS = Path(__file__).resolve().parents[2] / "scripts" / "tasks" / "minibugs"
VERIFIER = f"{MINIBUGS / 'verify.py'}:verify"

AGENT = """
import json, os, sys
task = json.loads(os.environ["LCAP_TASK"])
fix = next(f for f in map(json.loads, open(os.environ["MINIBUGS_FIXES"])) if f["id"] == task["id"])
(tests_file,) = task["tests"]
mode = sys.argv[1]
if mode == "fix":
    open(fix["file"], "w").write(fix["original"])
if mode == "tamper":
    open(tests_file, "w").write("import unittest\\nclass T(unittest.TestCase):\\n    def test_ok(self):\\n        pass\\n")
if mode == "extra":
    body = "".join(f"    def test_{i}(self):\\n        pass\\n" for i in range(20))
    open("test_extra.py", "w").write("import unittest\\nclass T(unittest.TestCase):\\n" + body)
if mode == "hang":
    open(fix["file"], "a").write("\\nwhile True:\\n    pass\\n")
print("agent", mode, task["id"])
"""


@pytest.fixture(scope="module")
def minibugs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("minibugs") / "set"
    made = subprocess.run(
        [sys.executable, str(MINIBUGS / "make.py"), "--seed", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    assert "train" in made.stdout and (out / "train.jsonl").is_file()
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _unfixed_reward(task: dict, fix: dict) -> float:
    return (task["test_count"] - len(fix["failing"])) / task["test_count"]


def test_a_workspace_runs_under_unittest_and_pytest(minibugs, tmp_path):
    task = _lines(minibugs / "train.jsonl")[0]
    fix = _lines(minibugs / "fixes.jsonl")[0]
    assert fix["id"] == task["id"]
    work = tmp_path / "work"
    shutil.copytree(minibugs / task["workspace"], work)
    runners = {
        "unittest": [sys.executable, "-m", "unittest", "-q"],
        "pytest": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
    }
    for name, argv in runners.items():
        assert subprocess.run(argv, cwd=work, capture_output=True, timeout=120).returncode == 1, name
    (work / fix["file"]).write_text(fix["original"])
    for name, argv in runners.items():
        done = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (name, done.stdout, done.stderr)


def test_collect_rewards_what_the_agent_did(minibugs, tmp_path):
    train = _lines(minibugs / "train.jsonl")
    fixes = {f["id"]: f for f in _lines(minibugs / "fixes.jsonl")}
    # partial rewards need a bug that some of its task's tests miss
    partial = [t for t in train if 0 < _unfixed_reward(t, fixes[t["id"]]) < 1]
    modes = ["fix", "none", "tamper", "extra", "hang"]
    chosen = [{**task, "mode": mode} for task, mode in zip(partial, modes, strict=False)]
    assert len(chosen) == len(modes)
    chosen[-1]["test_timeout"] = 3
    tasks = minibugs / "collect-tasks.jsonl"  # beside train.jsonl: `workspace` is relative to the tasks file
    tasks.write_text("".join(json.dumps(t) + "\n" for t in chosen))
    (tmp_path / "agent.py").write_text(AGENT)
    env = {**os.environ, "LCAP_HOME": str(tmp_path / "home"), "MINIBUGS_FIXES": str(minibugs / "fixes.jsonl")}
    argv = [
        str(Path(sys.executable).parent / "lcap"),
        "collect",
        "--tasks",
        str(tasks),
        "--db",
        str(tmp_path / "lcap.duckdb"),
        "--run-dir",
        str(tmp_path / "run"),
        "-g",
        "1",
        "-j",
        "3",
        "--upstream",
        "none",
        "--verifier",
        VERIFIER,
        "--",
        sys.executable,
        str(tmp_path / "agent.py"),
        "{mode}",
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = Store(tmp_path / "lcap.duckdb").fetchall(
        "SELECT e.task_id, e.status, r.reward, r.source, r.details, e.cwd FROM episodes e "
        "JOIN latest_rewards r USING (episode_id)"
    )
    got = {row[0]: row for row in rows}
    assert sorted(got) == sorted(t["id"] for t in chosen)
    by_mode = {t["mode"]: (t, got[t["id"]]) for t in chosen}
    for _, row in by_mode.values():
        assert row[1] == "ok"

    task, row = by_mode["fix"]
    assert row[2:4] == (1.0, VERIFIER) and json.loads(row[4])["failures"] == []

    task, row = by_mode["none"]
    details = json.loads(row[4])
    assert row[2] == pytest.approx(_unfixed_reward(task, fixes[task["id"]]))
    assert sorted(f["test"] for f in details["failures"]) == fixes[task["id"]]["failing"]
    assert details["total"] == task["test_count"]

    task, row = by_mode["tamper"]
    assert row[2:4] == (0.0, "tamper-guard") and json.loads(row[4])["tampered"] == list(task["tests"])

    task, row = by_mode["extra"]  # the agent's own passing tests do not count
    assert row[2] == pytest.approx(_unfixed_reward(task, fixes[task["id"]]))
    assert (Path(row[5]) / "test_extra.py").is_file()

    task, row = by_mode["hang"]
    assert row[2] == 0.0 and json.loads(row[4])["reason"] == "tests timed out after 3s"


def _context(minibugs: Path, tmp_path: Path) -> tuple[VerifierContext, dict, dict]:
    task = _lines(minibugs / "train.jsonl")[0]
    fix = next(f for f in _lines(minibugs / "fixes.jsonl") if f["id"] == task["id"])
    work = tmp_path / "ep" / "work"
    shutil.copytree(minibugs / task["workspace"], work)
    return VerifierContext(task, "ep-1", work, "", 0, "ok"), task, fix


def test_the_verifier_puts_back_the_tests(minibugs, tmp_path):
    """Without the tamper guard (a task line with no `protected`), an edited or deleted test file is still
    replaced by the task's own before the run."""
    ctx, task, fix = _context(minibugs, tmp_path)
    verify = load_verifier(VERIFIER)
    (tests_file,) = task["tests"]
    (ctx.workdir / tests_file).write_text(
        "import unittest\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    )
    assert verify(ctx).reward == pytest.approx(_unfixed_reward(task, fix))
    assert (ctx.workdir / tests_file).read_text() == task["tests"][tests_file]
    (ctx.workdir / tests_file).unlink()
    (ctx.workdir / tests_file).mkdir()
    (ctx.workdir / fix["file"]).write_text(fix["original"])
    assert verify(ctx).reward == 1.0


def test_a_skipped_test_is_not_a_pass(minibugs, tmp_path):
    ctx, task, fix = _context(minibugs, tmp_path)
    functions = [n.name for n in ast.parse(fix["original"]).body if isinstance(n, ast.FunctionDef)]
    skips = "".join(f"\ndef {name}(*args):\n    raise unittest.SkipTest('later')\n" for name in functions)
    (ctx.workdir / fix["file"]).write_text("import unittest\n" + fix["original"] + skips)
    verdict = load_verifier(VERIFIER)(ctx)
    assert verdict.reward == 0.0 and verdict.details["passed"] == 0 and functions
    assert len(verdict.details["failures"]) == verdict.details["total"] == task["test_count"]
    assert all(f["error"] == "skipped: later" for f in verdict.details["failures"])
    (ctx.workdir / fix["file"]).write_text("def broken(:\n")
    verdict = load_verifier(VERIFIER)(ctx)
    assert verdict.reward == 0.0 and "SyntaxError" in json.dumps(verdict.details["failures"])


def test_a_package_named_as_the_tests_does_not_stand_in_for_them(minibugs, tmp_path):
    """A package folder named as the test module wins Python's import over the `.py` file the verifier restores
    (and the tamper guard watches the file only): the task's own tests still run."""
    ctx, task, fix = _context(minibugs, tmp_path)
    (tests_file,) = task["tests"]
    body = "".join(f"    def test_{i}(self):\n        pass\n" for i in range(task["test_count"]))
    package = ctx.workdir / tests_file[: -len(".py")]
    package.mkdir()
    (package / "__init__.py").write_text("import unittest\nclass T(unittest.TestCase):\n" + body)
    verdict = load_verifier(VERIFIER)(ctx)
    assert verdict.reward == pytest.approx(_unfixed_reward(task, fix)) and verdict.reward < 1.0


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the verifier confines the tests with bubblewrap")
def test_a_process_the_tests_detach_ends_with_them(minibugs, tmp_path):
    """A process the module under test starts in a session of its own (out of the process group) ends when the
    test run does: it holds a lock on a file before the tests go on, and the lock is free once the verifier
    returns (a bounded wait)."""
    ctx, _, fix = _context(minibugs, tmp_path)
    lock = tmp_path / "held"
    lock.touch()
    detach = f"""
import fcntl, os, time
ready, told = os.pipe()
middle = os.fork()
if middle == 0:
    os.setsid()
    if os.fork() == 0:
        held = open({str(lock)!r})
        fcntl.flock(held, fcntl.LOCK_EX)
        os.write(told, b"x")
        time.sleep(180)
    os._exit(0)
os.waitpid(middle, 0)
os.read(ready, 1)
"""
    (ctx.workdir / fix["file"]).write_text(fix["original"] + detach)
    assert load_verifier(VERIFIER)(ctx).reward == 1.0
    with open(lock) as f:
        deadline = time.monotonic() + 60
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the detached process outlived the test run"
                time.sleep(0.1)
