"""`lcap collect --sandbox` with many short episodes set up and torn down at once (real bwrap, cgroups v1, a real
capture proxy and DuckDB file): a sandbox's set-up does not depend on the other episodes' mounts, which come and
go meanwhile (an overlay workspace's layer unmounted while another sandbox binds the folders it is in), so no
episode is lost: a sandbox binds the system folders and the agent's script's, not the host's / (with the run
folder in it), so no sandbox's mount table holds another episode's mount.
The issue's measurement at scale (hundreds of episodes under CPU hogs) is benchmarks/bench_sandbox_churn.py."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from lcap.capture.sandbox import missing
from lcap.dataset.collect.episodes import collect_episodes
from lcap.dataset.options import CollectOptions
from lcap.store import Store

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"--sandbox cannot run here: {missing()}")

EPISODES, CONCURRENCY = 40, 8
# The agent reads its workspace, then fails if its sandbox holds a mount of another episode's (what a set-up
# depended on): its mount table lists only its own workspace of the run folder.
AGENT = """#!/bin/sh
cat a.txt >/dev/null || exit 1
sleep 0.2
others=$(grep /round-0/ /proc/self/mountinfo | grep -vc "$LCAP_EPISODE_ID")
grep /round-0/ /proc/self/mountinfo | grep -v "$LCAP_EPISODE_ID" >&2
[ "$others" = 0 ]
"""


def test_concurrent_sandboxes_lose_no_episode(fake_llm):
    base = Path(tempfile.mkdtemp(prefix="lcap-sandbox-churn-"))  # the agent runs as nobody: pytest's tree is root's
    base.chmod(0o755)
    (base / "ws").mkdir()
    (base / "ws" / "a.txt").write_text("a")
    (base / "agent").mkdir()  # beside the run folder: the sandbox shows the script's folder, not the run's
    (base / "agent" / "agent.sh").write_text(AGENT)
    (base / "agent" / "agent.sh").chmod(0o755)
    rows = [{"id": f"t{i}", "workspace": "ws"} for i in range(EPISODES)]
    (base / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    old_home, old_cwd = os.environ.get("LCAP_HOME"), os.getcwd()
    os.environ["LCAP_HOME"] = str(base / "home")
    os.chdir(base)
    try:
        store = Store(base / "db" / "lcap.duckdb")
        options = CollectOptions(
            group_size=1,
            concurrency=CONCURRENCY,
            upstream=fake_llm.url,
            timeout=120.0,
            sandbox=True,
            sandbox_disk=4,
            run_dir=base / "run",
        )
        collect_episodes(
            store,
            tasks=base / "tasks.jsonl",
            command=[str(base / "agent" / "agent.sh")],
            options=options,
            progress=False,
        )
        statuses = store.fetchall("SELECT status, coalesce(error, '') FROM episodes")
    finally:
        os.chdir(old_cwd)
        if old_home is None:
            os.environ.pop("LCAP_HOME", None)
        else:
            os.environ["LCAP_HOME"] = old_home
        shutil.rmtree(base, ignore_errors=True)
    lost = [s for s in statuses if s[0] != "ok"]  # exit 1 (another episode's mount seen) or a failed set-up
    assert len(statuses) == EPISODES and lost == [], lost[:3]
