"""Sandboxes set up and torn down by the hundred under CPU hogs: does any episode get lost?

    .venv/bin/python benchmarks/bench_sandbox_churn.py [--episodes 400] [--concurrency 8] [--hogs 2]

`lcap collect --sandbox` (real bwrap, cgroups v1, the capture proxy, a DuckDB file) runs --episodes short episodes
--concurrency at a time while --hogs processes spin on the CPU. Each agent reads its overlay workspace, sleeps a
little and fails if its mount table holds another episode's mount: a sandbox's set-up must not depend on the
other episodes' mounts, which come and go meanwhile (issue #48 row 8: one episode in 48 was lost that way at
-j 4 under load). tests/integration/test_sandbox_churn.py runs the same agent at a size a test can afford.
Prints the episodes by status, the first errors, the wall time and episodes per minute; exits 1 if any was lost.
Needs what `--sandbox` needs (root, bubblewrap, cgroups v1).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from lcap.capture.sandbox import missing
from lcap.dataset.collect.episodes import collect_episodes
from lcap.dataset.options import CollectOptions
from lcap.store import Store

AGENT = """#!/bin/sh
cat a.txt >/dev/null || exit 1
sleep 0.2
others=$(grep /round-0/ /proc/self/mountinfo | grep -vc "$LCAP_EPISODE_ID")
grep /round-0/ /proc/self/mountinfo | grep -v "$LCAP_EPISODE_ID" >&2
[ "$others" = 0 ]
"""


def spin() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--hogs", type=int, default=2, help="processes spinning on the CPU meanwhile")
    args = parser.parse_args()
    if (why := missing()) is not None:
        print(f"--sandbox cannot run here: {why}", file=sys.stderr)
        return 2

    base = Path(tempfile.mkdtemp(prefix="lcap-churn-"))  # the agent runs as nobody: the folders must be open to it
    base.chmod(0o755)
    (base / "ws").mkdir()
    (base / "ws" / "a.txt").write_text("a")
    (base / "agent").mkdir()
    (base / "agent" / "agent.sh").write_text(AGENT)
    (base / "agent" / "agent.sh").chmod(0o755)
    rows = [{"id": f"t{i}", "workspace": "ws"} for i in range(args.episodes)]
    (base / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.environ["LCAP_HOME"] = str(base / "home")  # set once, before anything runs
    hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    try:
        store = Store(base / "db" / "lcap.duckdb")
        options = CollectOptions(
            group_size=1,
            concurrency=args.concurrency,
            upstream="none",
            timeout=120.0,
            sandbox=True,
            sandbox_disk=4,
            run_dir=base / "run",
        )
        start = time.perf_counter()
        collect_episodes(store, tasks=base / "tasks.jsonl", command=[str(base / "agent" / "agent.sh")], options=options)
        seconds = time.perf_counter() - start
        by_status = store.fetchall("SELECT status, count(*) FROM episodes GROUP BY ALL ORDER BY ALL")
        errors = store.fetchall("SELECT DISTINCT left(coalesce(error, ''), 300) FROM episodes WHERE status <> 'ok'")
    finally:
        for hog in hogs:
            hog.terminate()
        shutil.rmtree(base, ignore_errors=True)
    total = sum(n for _, n in by_status)
    lost = total - dict(by_status).get("ok", 0) + (args.episodes - total)
    print(f"{args.episodes} sandboxed episodes at -j {args.concurrency} beside {args.hogs} CPU hogs: {by_status}")
    for (error,) in errors[:5]:
        print(f"  {error}")
    print(f"lost {lost} of {args.episodes}; {seconds:.1f} s wall, {60 * args.episodes / seconds:.0f} episodes/min")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
