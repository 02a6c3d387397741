"""`lcap rescore --sandbox` by the real CLI on a real DuckDB store, with real bubblewrap (root here): a verifier run
sandboxed cannot read a canary file of the host outside its workspace, nor the store, nor reach the host's
loopback, runs as nobody, and its score is stored; an episode collected with --sandbox is verified sandboxed
without the flag; the same verifier unsandboxed (the control) reads and reaches all of it (issue 48 row 7)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fixtures_capture import SocketServer

from lcap.capture.sandbox import AGENT_UID, missing
from lcap.store import Store

LCAP = str(Path(sys.executable).parent / "lcap")
SYSTEM_PYTHON = "/usr/bin/python3"  # the verifier runs as nobody, who cannot reach a Python under /root
pytestmark = [
    pytest.mark.skipif(missing() is not None, reason=f"--sandbox cannot run here: {missing()}"),
    pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"no {SYSTEM_PYTHON}"),
]

# Tries each wall, then scores the transcript's answer: what it could do goes to the reward's details.
VERIFY = r"""
import json, os, socket, sys
probe = json.loads(open(os.environ["PROBE"]).read()) if os.path.exists(os.environ["PROBE"]) else {}
def can_read(path):
    try:
        open(path, "rb").read(1)
        return True
    except OSError:
        return False
try:
    socket.create_connection(("127.0.0.1", int(os.environ["HOST_PORT"])), timeout=3).close()
    loopback = True
except OSError as exc:
    loopback = False
open("written-by-verifier.txt", "w").write("x")
transcript = json.load(open(os.environ["LCAP_TRANSCRIPT"]))
answer = (transcript["messages"] or [{}])[-1].get("content")
print(json.dumps({
    "reward": 1.0 if answer == "Paris" else 0.0,
    "canary": can_read(os.environ["CANARY"]),
    "store": can_read(os.environ["STORE"]),
    "loopback": loopback,
    "uid": os.getuid(),
    "files": sorted(os.listdir(".")),
}))
"""


class Listener(SocketServer):
    """A host loopback port that counts the connections it gets."""

    def __init__(self) -> None:
        self.accepted = 0
        super().__init__(self._count)

    def _count(self, conn: socket.socket) -> None:
        self.accepted += 1
        conn.close()


def _episode(store: Store, episode_id: str, answer: str, workdir: Path | None, **labels: str) -> None:
    at = datetime.now(UTC)
    store.append(
        "episodes",
        [
            {
                "episode_id": episode_id,
                "status": "ok",
                "exit_code": 0,
                "cwd": str(workdir) if workdir else None,
                "labels": json.dumps({"task": "capital", "collect": "c-1", **labels}),
                "task_id": "capital",
                "round": 1,
                "sample": 0,
                "started_at": at,
                "ended_at": at,
            }
        ],
    )
    request = {"model": "m", "messages": [{"role": "user", "content": "The capital of France?"}]}
    turn = {"turn_id": f"{episode_id}/0", "episode_id": episode_id, "seq": 0, "dialect": "chat", "status_code": 200}
    store.append(
        "turns",
        [
            {
                **turn,
                "request": json.dumps(request),
                "completion_text": answer,
                "finish_reason": "stop",
                "started_at": at,
            }
        ],
    )


@pytest.fixture
def world():
    """A store with a kept workspace, the verifier, a canary in the host's /tmp and a host loopback listener."""
    base = Path(tempfile.mkdtemp(prefix="lcap-rescore-box-"))
    base.chmod(0o755)
    outside = Path(tempfile.mkdtemp(prefix="lcap-outside-"))  # beside it in the host's /tmp: never shown
    outside.chmod(0o755)  # world-readable: what keeps it out is the sandbox, not its mode
    canary = outside / "canary.txt"
    canary.write_text("canary")
    (base / "verify.py").write_text(VERIFY)
    workdir = base / "run" / "round-1" / "ep-kept" / "work"
    workdir.mkdir(parents=True)
    (workdir / "answer.txt").write_text("Paris")
    (workdir.parent / "stdout.txt").write_text("Paris\n")
    (base / "db").mkdir()
    store = Store(base / "db" / "lcap.duckdb")
    listener = Listener()
    env = {"CANARY": str(canary), "STORE": str(store.path), "HOST_PORT": str(listener.port), "PROBE": "/nonexistent"}
    yield store, base, workdir, listener, env
    listener.close()
    for folder in (base, outside):
        shutil.rmtree(folder, ignore_errors=True)


def _rescore(store: Store, base: Path, env: dict[str, str], source: str, *extra: str) -> subprocess.CompletedProcess:
    verifier = f"{SYSTEM_PYTHON} {base / 'verify.py'}"
    return subprocess.run(
        [LCAP, "rescore", "--db", str(store.path), "--verifier", verifier, "--where", "true", "--source", source,
         "--timeout", "60", *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, **env}, cwd=base,
    )  # fmt: skip


def _details(store: Store, source: str) -> dict[str, tuple[float, dict]]:
    rows = store.fetchall("SELECT episode_id, value, details FROM rewards WHERE source = ?", [source])
    return {eid: (value, json.loads(details)) for eid, value, details in rows}


def test_rescore_sandbox_walls_the_verifier_off_and_stores_its_score(world):
    store, base, workdir, listener, env = world
    _episode(store, "ep-kept", "Paris", workdir)
    _episode(store, "ep-bare", "Lyon", None)
    done = _rescore(store, base, env, "boxed", "--sandbox")
    assert done.returncode == 0, done.stdout + done.stderr
    got = _details(store, "boxed")
    assert {eid: value for eid, (value, _) in got.items()} == {"ep-kept": 1.0, "ep-bare": 0.0}  # scores stored
    for _, details in got.values():
        assert details["canary"] is False  # a world-readable file of the host's /tmp: not there
        assert details["store"] is False  # the store's file: hidden
        assert details["loopback"] is False  # no network at all
        assert details["uid"] == AGENT_UID and details["sandboxed"] is True
    assert listener.accepted == 0
    kept = got["ep-kept"][1]
    assert "answer.txt" in kept["files"] and "written-by-verifier.txt" in kept["files"]  # over its workspace
    assert not (workdir / "written-by-verifier.txt").exists()  # what it wrote went with its sandbox


def test_an_episode_collected_with_sandbox_is_verified_sandboxed_without_the_flag(world):
    store, base, workdir, listener, env = world
    _episode(store, "ep-boxed", "Paris", None, sandbox="true")  # collect --sandbox labels its episodes so
    _episode(store, "ep-host", "Paris", workdir)
    done = _rescore(store, base, env, "auto")
    assert done.returncode == 0, done.stdout + done.stderr
    got = _details(store, "auto")
    boxed, host = got["ep-boxed"][1], got["ep-host"][1]
    assert (boxed["uid"], boxed["canary"], boxed["loopback"], boxed["sandboxed"]) == (AGENT_UID, False, False, True)
    # the control: the same verifier on the host reads the canary and reaches the loopback (the walls are the
    # sandbox's, not the test's)
    assert (host["uid"], host["canary"], host["loopback"]) == (os.getuid(), True, True) and "sandboxed" not in host
    assert listener.accepted == 1
    assert (workdir / "written-by-verifier.txt").exists()


def test_without_bubblewrap_a_sandboxed_rescore_is_a_one_line_error(world, tmp_path):
    store, base, _, _, env = world
    _episode(store, "ep-boxed", "Paris", None, sandbox="true")
    bin_dir = tmp_path / "bin"  # a PATH without bwrap
    bin_dir.mkdir()
    done = _rescore(store, base, {**env, "PATH": str(bin_dir)}, "nobwrap")
    assert done.returncode == 2 and done.stderr.startswith("lcap: rescore runs verifiers sandboxed"), done.stderr
    assert "collected with --sandbox" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert _details(store, "nobwrap") == {}
