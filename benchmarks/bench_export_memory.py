"""`lcap export`'s peak memory on a store holding N MB of conversation text: the streaming export beside the one it
replaced (the whole selection in memory, git d3da54f), each format, side by side.

    .venv/bin/python benchmarks/bench_export_memory.py [--mb 300] [--episodes 20000] [--before d3da54f]

The store is made in SQL: one chat call an episode (a system prompt of `mb / episodes` of text, a question, an
answer), rewards on all. Each export runs in a child process of its own (the store opened, the selection written),
and its peak RSS is the child's `ru_maxrss`; the two implementations alternate per format, so a busy machine
slows both alike. The figure to read is the peak RSS for the same text; seconds are shown too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lcap.store import Store

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import importlib.util, sys
from pathlib import Path
from lcap.store import Store
spec = importlib.util.spec_from_file_location("export_under_test", sys.argv[1])
module = sys.modules["export_under_test"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
report = module.export(Store(Path(sys.argv[2])), format=sys.argv[3], out=Path(sys.argv[4]))
print(report.line())
"""


def make_store(path: Path, *, mb: float, episodes: int) -> Store:
    store = Store(path)
    chunks = max(1, int(mb * 1e6 / episodes / 32))  # md5 hex digests of 32 characters
    with store.connect() as con:
        con.execute(
            f"""INSERT INTO episodes BY NAME
                SELECT 'ep' || e AS episode_id, 'python agent.py' AS command, 'ok' AS status,
                       json_object('task', 't' || (e // 8), 'split', 'train') AS labels, 't' || (e // 8) AS task_id,
                       1 AS round, (e % 8)::INTEGER AS sample, 'train' AS split,
                       now() + e * INTERVAL 1 MILLISECOND AS started_at, now() AS ended_at
                FROM range({episodes}) r(e)"""
        )
        con.execute(
            f"""INSERT INTO rewards BY NAME
                SELECT 'ep' || e AS episode_id, (e % 2)::DOUBLE AS value, '{{}}' AS details, 'bench' AS source,
                       now() AS created_at
                FROM range({episodes}) r(e)"""
        )
        con.execute(
            f"""INSERT INTO turns BY NAME
                SELECT 'tu' || e AS turn_id, 'ep' || e AS episode_id, 0 AS seq, now() AS started_at,
                       now() AS ended_at, 'chat' AS dialect, 200 AS status_code, 'stop' AS finish_reason,
                       json_object('model', 'policy', 'messages', json_array(
                           json_object('role', 'system', 'content',
                                       array_to_string(list_transform(range({chunks}), lambda i: md5(e || '-' || i)), '')),
                           json_object('role', 'user', 'content', 'What is ' || e || ' * 7?'))) AS request,
                       'Answer: ' || (e * 7) AS completion_text
                FROM range({episodes}) r(e)"""
        )
        text = con.execute("SELECT sum(length(request::VARCHAR)) FROM turns").fetchone()[0]
    print(
        f"store: {episodes} episodes, {text / 1e6:.0f} MB of request text, {path.stat().st_size / 1e6:.0f} MB on disk"
    )
    return store


def run(module: Path, store: Path, fmt: str, out: Path) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(module), str(store), fmt, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"export {fmt} with {module} failed:\n{output}")
    return usage.ru_maxrss / 2**20, time.perf_counter() - t0, output.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=300, help="MB of conversation text in the store")
    ap.add_argument("--episodes", type=int, default=20000)
    ap.add_argument("--before", default="d3da54f", help="the commit whose export.py to compare with")
    ap.add_argument("--formats", default="openai,hf,verl")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        tmp = Path(tmp)
        before = tmp / "export_before.py"
        before.write_text(
            subprocess.run(
                ["git", "-C", str(REPO), "show", f"{args.before}:dataset/build/export.py"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        after = REPO / "dataset" / "build" / "export.py"
        store = tmp / "store.duckdb"
        make_store(store, mb=args.mb, episodes=args.episodes)
        load = os.getloadavg()[0]
        print(f"{'format':<8} {'before GiB':>10} {'after GiB':>10} {'before s':>9} {'after s':>8}")
        for fmt in args.formats.split(","):
            out = tmp / f"out-{fmt}"
            old = run(before, store, fmt, Path(f"{out}-before.jsonl" if fmt == "openai" else f"{out}-before"))
            new = run(after, store, fmt, Path(f"{out}-after.jsonl" if fmt == "openai" else f"{out}-after"))
            print(f"{fmt:<8} {old[0]:>10.2f} {new[0]:>10.2f} {old[1]:>9.1f} {new[1]:>8.1f}   {new[2]}", flush=True)
        print(f"load {load:.2f} at start, {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
