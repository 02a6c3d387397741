"""`lcap collect --sandbox`: workspaces from a task's `workspace` directory or its `repo` at a `commit` (an overlay
over a copy made once per run; a repository cloned once into lcap's cache), and the verifier in a fresh sandbox of
its own over the agent's final workspace, with the task's pristine `tests` put over it (real bwrap, cgroups v1, a
real git repository, a real capture proxy and DuckDB file). One collect with a command verifier, one with a Python
function verifier: an agent that edits the tests is scored on the pristine ones, a verifier that tries to write
outside or reach a host port gets nowhere, and the agent's workspace is left as the agent left it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from lcap.capture.sandbox import missing
from lcap.dataset.collect.episodes import EpisodePool, collect_episodes, plan_collect
from lcap.dataset.collect.workspaces import place_tests
from lcap.dataset.options import CollectOptions
from lcap.store import Store

SYSTEM_PYTHON = "/usr/bin/python3"
pytestmark = [
    pytest.mark.skipif(missing() is not None, reason=f"--sandbox cannot run here: {missing()}"),
    pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"no {SYSTEM_PYTHON}"),
    pytest.mark.skipif(shutil.which("git") is None, reason="no git"),
]

DISK_MB = 16
BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
TESTS = (
    "import unittest\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
    "    def test_zero(self):\n        self.assertEqual(add(0, 0), 0)\n"
)
FAKE_TESTS = "import unittest\n\n\nclass TestAdd(unittest.TestCase):\n    def test_add(self):\n        pass\n"

AGENT = r"""
import json, os, subprocess, sys
task = json.loads(os.environ["LCAP_TASK"])
mode = task["mode"]
report = {"uid": os.getuid(), "files": sorted(os.listdir("."))}
if os.path.isdir(".git"):
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    report["head"] = git.stdout.strip() or git.stderr.strip()
if mode in ("cheat", "fix"):
    open("test_calc.py", "w").write(task["fake_tests"])
if mode == "fix":
    open("calc.py", "w").write(task["fix"])
if mode == "disk":
    with open("fill.bin", "wb") as f:
        for _ in range(4 * task["disk_mb"]):
            f.write(b"x" * (1 << 20))
            f.flush()
print(json.dumps(report))
"""

# What both verifiers do: an escape where the task asks for one, a mark left in the workspace, then the tests.
CHECK = r"""
def check(task, python):
    import os, socket, subprocess
    details = {"uid": os.getuid()}
    if task.get("escape"):
        try:
            open(task["target"], "w").write("escaped")
            details["wrote"] = True
        except OSError:
            details["wrote"] = False
        try:
            socket.create_connection(("127.0.0.1", task["port"]), timeout=3).close()
            details["connected"] = True
        except OSError:
            details["connected"] = False
        print("escape attempted", flush=True)
    open("verifier_was_here", "w").write("x")
    run = subprocess.run([python, "-m", "unittest", "test_calc"], capture_output=True, text=True, timeout=60)
    print(run.stderr[-2000:], flush=True)
    return (1.0 if run.returncode == 0 else 0.0), details
"""

COMMAND_VERIFIER = (
    "import json, os, sys\n"
    + CHECK
    + "reward, details = check(json.loads(os.environ['LCAP_TASK']), sys.executable)\n"
    + "print(json.dumps({'reward': reward, **details}))\n"
)

PYTHON_VERIFIER = CHECK + "\n\ndef judge(ctx):\n    import sys\n    return check(ctx.task, sys.executable)\n"


class Listener:
    """A host loopback port that counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def world(fake_llm):
    """A base folder nobody may read, a git repository with a buggy and a fixed commit, a workspace folder, the
    pristine tests, a host port, a target outside; run(verifier spec) collects the tasks with it."""
    base = Path(tempfile.mkdtemp(prefix="lcap-sandbox-ws-"))
    base.chmod(0o755)
    repo = base / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "calc.py").write_text(BUGGY)
    (repo / "test_calc.py").write_text(TESTS)
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "buggy")
    buggy = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc.py").write_text(FIXED)
    _git(repo, "commit", "-q", "-am", "fixed")
    (base / "pristine").mkdir()
    (base / "pristine" / "test_calc.py").write_text(TESTS)
    (base / "ws").mkdir()
    (base / "ws" / "calc.py").write_text(BUGGY)
    (base / "ws" / "test_calc.py").write_text(TESTS)
    (base / "agent.py").write_text(AGENT)
    (base / "verify.py").write_text(COMMAND_VERIFIER)
    (base / "verify_fn.py").write_text(PYTHON_VERIFIER)
    listener = Listener()
    target = base / "outside.txt"
    common = {"fake_tests": FAKE_TESTS, "fix": FIXED, "tests": "pristine/test_calc.py", "disk_mb": DISK_MB}
    repo_task = {"repo": "repo", "commit": buggy}
    rows = [
        {"id": "cheat", "mode": "cheat", **repo_task, **common},
        {"id": "fix", "mode": "fix", **repo_task, **common},
        {"id": "disk", "mode": "disk", "workspace": "ws", **common},
        {"id": "escape", "mode": "none", "workspace": "ws", "escape": True, "target": str(target)},
    ]
    rows[-1].update(port=listener.port, fix=FIXED, tests={"test_calc.py": TESTS})
    (base / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    old_home, old_cwd = os.environ.get("LCAP_HOME"), os.getcwd()
    os.environ["LCAP_HOME"] = str(base / "home")
    os.chdir(base)

    def run(verifier: str) -> tuple[dict, Path, Store]:
        fake_llm.reset()
        store = Store(base / f"db-{verifier.split(':')[0]}" / "lcap.duckdb")
        options = CollectOptions(
            group_size=2,
            concurrency=4,
            upstream=fake_llm.url,
            timeout=60.0,
            verifier=verifier,
            verifier_timeout=60.0,
            sandbox=True,
            sandbox_disk=DISK_MB,
            keep_workspaces=True,
            run_dir=base / f"run-{verifier.split(':')[0]}",
        )
        result = collect_episodes(
            store, tasks=base / "tasks.jsonl", command=[SYSTEM_PYTHON, "agent.py"], options=options, progress=False
        )
        rows = store.fetchall(
            "SELECT e.labels->>'task', e.episode_id, e.status, e.error, r.value, r.details FROM episodes e "
            "LEFT JOIN rewards r USING (episode_id) ORDER BY e.labels->>'task', e.labels->>'sample'"
        )
        episodes: dict[str, list[dict]] = {}
        for task, eid, status, error, value, details in rows:
            episodes.setdefault(task, []).append(
                {
                    "id": eid,
                    "status": status,
                    "error": error or "",
                    "reward": value,
                    "details": json.loads(details) if details else {},
                    "dir": Path(result.run_dir) / "round-0" / eid,
                }
            )
        return episodes, Path(result.run_dir), store

    try:
        yield {"run": run, "base": base, "buggy": buggy, "target": target, "listener": listener}
    finally:
        os.chdir(old_cwd)
        if old_home is None:
            os.environ.pop("LCAP_HOME", None)
        else:
            os.environ["LCAP_HOME"] = old_home
        listener.sock.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def command_run(world):
    return world["run"]("python3 verify.py")


@pytest.fixture(scope="module")
def python_run(world):
    return world["run"]("verify_fn.py:judge")


def _report(episode: dict) -> dict:
    return json.loads((episode["dir"] / "stdout.txt").read_text().strip().splitlines()[-1])


def test_repo_task_starts_at_its_commit_from_one_cached_clone(world, command_run):
    episodes, _, _ = command_run
    for episode in episodes["cheat"] + episodes["fix"]:
        report = _report(episode)
        assert report["head"] == world["buggy"], report
        assert {"calc.py", "test_calc.py", ".git"} <= set(report["files"])
        assert report["uid"] != 0
    cache = world["base"] / "home" / "cache" / "repos"
    assert len(list(cache.glob("*.git"))) == 1  # one mirror of the repository
    assert len([p for p in cache.iterdir() if p.is_dir() and not p.name.endswith(".git")]) == 1  # one checkout


def test_agent_that_edits_the_tests_is_scored_on_the_pristine_ones(command_run):
    episodes, _, _ = command_run
    for episode in episodes["cheat"]:
        assert episode["status"] == "ok" and episode["reward"] == 0.0, episode
    for episode in episodes["fix"]:
        assert episode["status"] == "ok" and episode["reward"] == 1.0, episode["details"]
        assert "Ran 2 tests" in episode["details"]["verifier_output"]  # the pristine file's two tests, not one
        assert "Ran 2 tests" in (episode["dir"] / "verifier.txt").read_text()


def test_pristine_tests_are_readable_while_a_store_write_is_open_beside_them(tmp_path):
    """A store write beside them (a unit of work open meanwhile) leaves the pristine tests placed readable by the
    sandbox's user, or its verifier scores a fixed bug 0 (permission denied)."""
    work = tmp_path / "work"
    work.mkdir()
    with Store(tmp_path / "beside.duckdb").connect():
        place_tests(work, {"test_calc.py": TESTS.encode(), "tests/unit/test_more.py": b"pass\n"})
    modes = {str(p.relative_to(work)): stat.S_IMODE(p.stat().st_mode) for p in sorted(work.rglob("*"))}
    assert modes == {"test_calc.py": 0o644, "tests": 0o755, "tests/unit": 0o755, "tests/unit/test_more.py": 0o644}


def test_a_sandboxed_episode_runs_and_is_verified_while_a_store_write_is_open(fake_llm):
    """The folders and files lcap makes for a sandboxed episode get the user's modes even while a store write is
    open (here: on another store, for the whole collect): the agent, as nobody, enters its workspace, and the
    verifier reads the agent's stdout and the pristine tests."""
    base = Path(tempfile.mkdtemp(prefix="lcap-sandbox-umask-"))
    base.chmod(0o755)
    try:
        (base / "ws").mkdir()
        (base / "ws" / "calc.py").write_text(FIXED)
        (base / "pristine").mkdir()
        (base / "pristine" / "test_calc.py").write_text(TESTS)
        (base / "agent.py").write_text("print('hello from the agent')\n")
        (base / "verify.py").write_text(
            "import json, os, subprocess, sys\n"
            "said = open(os.environ['LCAP_AGENT_STDOUT']).read()\n"
            "run = subprocess.run([sys.executable, '-m', 'unittest', 'test_calc'], capture_output=True)\n"
            "print(json.dumps({'reward': float(run.returncode == 0 and 'hello' in said)}))\n"
        )
        task = {"id": "t", "workspace": "ws", "tests": "pristine/test_calc.py"}
        (base / "tasks.jsonl").write_text(json.dumps(task) + "\n")
        store = Store(base / "db" / "lcap.duckdb")
        options = CollectOptions(
            group_size=2,
            upstream=fake_llm.url,
            timeout=60.0,
            verifier=f"python3 {base / 'verify.py'}",
            sandbox=True,
            run_dir=base / "run",
        )
        with Store(base / "db" / "beside.duckdb").connect():
            collect_episodes(
                store,
                tasks=base / "tasks.jsonl",
                command=[SYSTEM_PYTHON, str(base / "agent.py")],
                options=options,
                progress=False,
            )
        rows = store.fetchall(
            "SELECT e.status, e.error, r.value FROM episodes e LEFT JOIN rewards r USING (episode_id) ORDER BY 1"
        )
        assert rows == [("ok", None, 1.0)] * 2, rows
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_verifier_leaves_the_agents_workspace_as_the_agent_left_it(command_run):
    episodes, _, _ = command_run
    work = episodes["cheat"][0]["dir"] / "work"  # kept by --keep-workspaces
    assert (work / "test_calc.py").read_text() == FAKE_TESTS
    assert not (work / "verifier_was_here").exists()


def test_a_verifier_cannot_write_outside_or_reach_the_host(world, command_run):
    episodes, _, _ = command_run
    for episode in episodes["escape"]:
        details = episode["details"]
        assert episode["status"] == "ok", episode
        assert details["wrote"] is False and details["connected"] is False and details["uid"] != 0, details
        assert episode["reward"] == 0.0  # the workspace's bug is still there
    assert not world["target"].exists()
    assert world["listener"].accepted == 0


def test_disk_limit_holds_on_an_overlay_workspace(command_run):
    episodes, _, _ = command_run
    for episode in episodes["disk"]:
        assert episode["status"] == "failed", episode
        assert f"disk limit ({DISK_MB} MiB) reached" in episode["error"]


def test_python_verifier_runs_in_a_sandbox_too(world, python_run):
    episodes, _, _ = python_run
    assert [e["reward"] for e in episodes["cheat"]] == [0.0, 0.0]
    assert [e["reward"] for e in episodes["fix"]] == [1.0, 1.0]
    for episode in episodes["escape"]:
        details = episode["details"]
        assert details["wrote"] is False and details["connected"] is False and details["uid"] != 0, details
        assert "escape attempted" in details["verifier_output"]
    assert not world["target"].exists()
    assert world["listener"].accepted == 0


def test_nothing_is_left_mounted_and_the_lower_layers_are_gone(command_run, python_run):
    for _, run_dir, _ in (command_run, python_run):
        assert str(run_dir) not in Path("/proc/self/mountinfo").read_text()
        assert not list(run_dir.glob(".lcap-lowers-*"))


NS_AGENT = r"""
import json, os
print(json.dumps({"uid": os.getuid(), **{ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "net", "mnt")}}))
"""


def test_async_loops_episode_pool_runs_episodes_and_verifiers_sandboxed(world):
    """`lcap loop --async --sandbox` runs its episodes on an `EpisodePool` with the loop's collect options: each
    agent in namespaces of its own as nobody, and its verifier (which answers its uid as the reward) sandboxed."""
    base = world["base"]
    (base / "ns_agent.py").write_text(NS_AGENT)
    tasks = base / "ns.jsonl"
    tasks.write_text('{"id": "ns", "workspace": "ws"}\n')
    store = Store(base / "db-pool" / "lcap.duckdb")
    options = CollectOptions(
        group_size=2,
        concurrency=2,
        upstream=None,
        timeout=60.0,
        verifier="python3 -c 'import os; print(os.getuid())'",
        sandbox=True,
        run_dir=base / "run-pool",
    )
    plan = plan_collect(tasks=tasks, command=[SYSTEM_PYTHON, "ns_agent.py"], options=options, store=store)
    with EpisodePool(store, options, None, 2) as pool:
        assert pool.submit(plan, plan.specs[:1]) == 1
        assert pool.submit(plan, plan.specs[1:]) == 1  # the loop submits group by group
        with pool.ended:
            assert pool.ended.wait_for(lambda: pool.result.finished + pool.result.failed >= 2, timeout=120)
        assert len(list(plan.run_dir.glob(".lcap-lowers-*/*"))) == 1  # the workspace's lower layer, made once
    assert not list(plan.run_dir.glob(".lcap-lowers-*"))  # and removed when the pool stops
    host = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "net", "mnt")}
    rows = store.fetchall(
        "SELECT e.episode_id, e.status, r.value FROM episodes e LEFT JOIN rewards r USING (episode_id)"
    )
    assert len(rows) == 2
    for eid, status, reward in rows:
        assert status == "ok" and reward == 65534.0, (eid, status, reward)
        report = json.loads((plan.run_dir / "round-0" / eid / "stdout.txt").read_text())
        assert report["uid"] == 65534
        assert all(report[ns] != host[ns] for ns in host), (report, host)
