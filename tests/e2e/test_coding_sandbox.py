"""Real coding agents in `lcap collect --sandbox` on the policy route: mini-swe-agent and Codex, unmodified (their
adapters in scripts/harnesses/), one minibugs task each, both episodes at once, each in a bubblewrap sandbox of its
own, against the session's tiny model; offline (scripts/harnesses/offline.py: only the policy's port is bridged in).

Each episode's command is a probe, then the harness: the probe records, from inside the sandbox, its user, what it
sees of the collect's round folder and whether it can read a decoy workspace placed there before the collect (a
sibling's MARKER.txt); the harness then runs as a user would run it. The checks: every call captured with exact
ids, minibugs' verifier's reward stored for each episode, each kept workspace holds its own marker only, and the
probe saw no sibling. The harnesses are installed (idempotent) where the sandbox's user, nobody, can run them:
LCAP_SANDBOX_HARNESS_DIR, default /var/cache/lcap-harnesses, with /usr/bin/python3's venvs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lcap.capture.sandbox import missing
from lcap.store import Store

from .test_harnesses import HARNESSES, LCAP, can_unshare, install

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(missing() is not None, reason=f"--sandbox cannot run here: {missing()}"),
]

REPO = Path(__file__).resolve().parents[2]
MINIBUGS = REPO / "scripts" / "tasks" / "minibugs"
SYSTEM_PYTHON = "/usr/bin/python3"  # the harnesses' venvs: the sandbox runs them as nobody, who cannot enter /root
AGENTS = {"mini-swe-agent": ("mini", "chat"), "codex-sse": ("codex", "responses")}  # run.sh name: install, dialect
EPISODE_TIMEOUT = 600

PROBE = """#!/bin/sh
round=$(dirname "$(dirname "$LCAP_WORKDIR")")
{
  echo "uid $(id -u)"
  echo "round $(ls -A "$round" | tr '\\n' ' ')"
  if cat "$LCAP_TEST_DECOY" >/dev/null 2>&1; then echo "decoy read"; else echo "decoy unreadable"; fi
} > "$LCAP_WORKDIR/probe.txt"
exec "$@"
"""


def sandbox_harness_dir() -> Path:
    return Path(os.environ.get("LCAP_SANDBOX_HARNESS_DIR") or "/var/cache/lcap-harnesses")


@dataclass
class Run:
    db: Path
    run_dir: Path
    markers: dict[str, str]  # task id -> its MARKER.txt
    harness: dict[str, str]  # task id -> its harness (run.sh's name)
    decoy: str  # the decoy workspace's marker
    collect: subprocess.CompletedProcess

    def episodes(self) -> dict[str, tuple[str, str, float | None, int]]:
        """task id -> (episode id, status, reward, n_turns)."""
        rows = Store(self.db).fetchall("SELECT task_id, episode_id, status, reward, n_turns FROM episode_summary")
        return {task: (episode, status, reward, n) for task, episode, status, reward, n in rows}


@pytest.fixture(scope="module")
def coding(vllm_server) -> Iterator[Run]:
    if not can_unshare():
        pytest.skip("no network namespace here (unshare --net): the harnesses must not reach the internet")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"no {SYSTEM_PYTHON} for the sandbox's harness venvs")
    failed = install(sorted({i for i, _ in AGENTS.values()}), sandbox_harness_dir(), SYSTEM_PYTHON)
    assert not failed, failed
    base = Path(tempfile.mkdtemp(prefix="lcap-coding-"))  # nobody must reach the workspaces: not pytest's tree
    base.chmod(0o755)
    made = subprocess.run(
        [sys.executable, str(MINIBUGS / "make.py"), "--seed", "0", "--out", str(base / "minibugs")],
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    rows = [json.loads(line) for line in (base / "minibugs" / "train.jsonl").open()][: len(AGENTS)]
    markers, harness = {}, {}
    with (base / "minibugs" / "coding.jsonl").open("w") as f:
        for row, name in zip(rows, AGENTS, strict=True):
            markers[row["id"]] = f"lcap-marker-{secrets.token_hex(12)}"
            harness[row["id"]] = row["harness"] = name
            row["files"] = {"MARKER.txt": markers[row["id"]] + "\n"}
            f.write(json.dumps(row) + "\n")
    (base / "probe.sh").write_text(PROBE)
    (base / "probe.sh").chmod(0o755)
    run_dir = base / "run"
    decoy = f"lcap-marker-{secrets.token_hex(12)}"
    sibling = run_dir / "round-0" / "decoy-episode" / "work" / "MARKER.txt"
    sibling.parent.mkdir(parents=True)
    sibling.write_text(decoy)
    for folder in (run_dir, run_dir / "round-0", sibling.parent.parent, sibling.parent):
        folder.chmod(0o755)
    sibling.chmod(0o644)  # a sibling readable by anyone who can reach it: only the sandbox stands in the way
    env = dict(
        os.environ,
        LCAP_HARNESS_DIR=str(sandbox_harness_dir()),
        LCAP_MAX_TURNS="2",
        LCAP_MAX_OUTPUT_TOKENS="24",
        LCAP_TEST_DECOY=str(sibling),
    )
    port = vllm_server.url.rsplit(":", 1)[1]
    command = [sys.executable, str(HARNESSES / "offline.py"), "--port", port, "--", LCAP, "collect"]
    command += ["--db", str(base / "db" / "lcap.duckdb"), "--tasks", str(base / "minibugs" / "coding.jsonl")]
    command += ["-g", "1", "-j", str(len(AGENTS)), "--timeout", str(EPISODE_TIMEOUT), "--verify-failed"]
    command += ["--sandbox", "--keep-workspaces", "--run-dir", str(run_dir)]
    command += ["--verifier", f"{MINIBUGS / 'verify.py'}:verify"]
    command += ["--", str(base / "probe.sh"), str(HARNESSES / "run.sh"), "{harness}", "{prompt}"]
    (base / "db").mkdir()
    vllm_server.use_base()
    try:
        t0 = time.perf_counter()
        done = subprocess.run(command, cwd=base, env=env, capture_output=True, text=True, timeout=3 * EPISODE_TIMEOUT)
        print(f"coding agents in the sandbox: collect {time.perf_counter() - t0:.1f} s")
        yield Run(base / "db" / "lcap.duckdb", run_dir, markers, harness, decoy, done)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=list(AGENTS))
def task(request, coding: Run) -> str:
    """The task id of one harness's episode."""
    return list(coding.markers)[list(AGENTS).index(request.param)]


def test_calls_captured_with_exact_ids(coding: Run, task: str):
    """The harness ran in its sandbox and every LLM call it made reached the policy, captured with its ids."""
    assert coding.collect.returncode == 0, coding.collect.stdout[-3000:] + coding.collect.stderr[-3000:]
    episode, status, _, n_turns = coding.episodes()[task]
    assert status == "ok" and n_turns >= 1, (status, n_turns, coding.collect.stdout[-3000:])
    rows = Store(coding.db).fetchall(
        "SELECT status_code, dialect, token_source, len(prompt_token_ids), len(completion_token_ids) FROM turns "
        "WHERE episode_id = ?",
        [episode],
    )
    dialect = AGENTS[coding.harness[task]][1]
    for code, got, source, prompt, completion in rows:
        assert code == 200 and got == dialect and source == "vllm" and prompt > 0 and completion > 0, rows


def test_minibugs_reward_stored(coding: Run, task: str):
    """minibugs' verifier graded the kept workspace: a reward in [0, 1] over the task's own tests."""
    episode, _, reward, _ = coding.episodes()[task]
    assert reward is not None and 0.0 <= reward <= 1.0
    ((source, details),) = Store(coding.db).fetchall(
        "SELECT source, details FROM rewards WHERE episode_id = ?", [episode]
    )
    assert source.endswith("verify.py:verify") and json.loads(details)["total"] >= 1, (source, details)


def test_episode_sees_no_sibling(coding: Run, task: str):
    """Inside its sandbox the agent was nobody, its round folder held only its own episode, the decoy sibling's
    workspace could not be read; its kept workspace holds its own marker only, and none of its calls carries
    another episode's marker or the decoy's."""
    episode = coding.episodes()[task][0]
    work = coding.run_dir / "round-0" / episode / "work"
    probe = dict(line.split(" ", 1) for line in (work / "probe.txt").read_text().splitlines())
    assert probe == {"uid": "65534", "round": f"{episode} ", "decoy": "unreadable"}, probe
    assert (work / "MARKER.txt").read_text().strip() == coding.markers[task]
    others = [m for t, m in coding.markers.items() if t != task] + [coding.decoy]
    for path in work.rglob("*"):
        assert not any(m.encode() in path.read_bytes() for m in others if path.is_file()), path
    ((text,),) = Store(coding.db).fetchall(
        "SELECT string_agg(CAST(request AS VARCHAR) || coalesce(CAST(response AS VARCHAR), ''), '') FROM turns "
        "WHERE episode_id = ?",
        [episode],
    )
    assert text and not any(m in text for m in others)
