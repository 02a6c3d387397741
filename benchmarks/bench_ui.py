"""Benchmark `lcap ui`'s episode list on a large store (default 1,000,000 turns); target: first page <= 500 ms.

    .venv/bin/python benchmarks/bench_ui.py [--turns N] [--db PATH] [--rounds R]

Builds the store with benchmarks/synthetic_store.py (250,000 episodes of 4 calls, groups of 8), or reuses
--db when it exists, starts `lcap ui` on it as a user would and asks for each page R times. Server time is
what the app reports in its Server-Timing header: the store's attach, the queries and the template (`total`),
the queries alone (`db`). Wall time is the HTTP round trip seen by the client. The first request of the
run (a cold attach) is printed apart.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from synthetic_store import make_store

PAGES = {
    "first page (newest first)": "/episodes",
    "filtered + sorted (round, flag truncated, reward >= 0.5, by reward)": (
        "/episodes?round=1&flag=truncated&reward_min=0.5&sort=reward&order=desc"
    ),
    "search (task id contains 't1234')": "/episodes?q=t1234",
    "sorted by task, 100 rows": "/episodes?sort=task&per_page=100",
    "deep page (page 2,000 of 5,000)": "/episodes?page=2000",
}
OTHERS = {"overview": "/", "episode page": "/episode?id=ep4242", "group page": "/group?round=1&split=train&task=t530"}


def server_ms(answer: httpx.Response) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+);dur=([\d.]+)", answer.headers.get("server-timing", ""))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=1_000_000)
    ap.add_argument("--db", type=Path, default=None, help="reuse this store if it exists, else build it there")
    ap.add_argument("--rounds", type=int, default=7, help="requests per page")
    ap.add_argument("--port", type=int, default=8767)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or Path(tmp) / "bench.duckdb"
        if not db.exists():
            t0 = time.perf_counter()
            make_store(db, turns=args.turns)
            print(f"generated {args.turns:,} turns in {time.perf_counter() - t0:.1f}s -> {db}")
        print(f"store {db} ({db.stat().st_size / 2**20:.0f} MiB)")
        lcap = str(Path(sys.executable).with_name("lcap"))
        proc = subprocess.Popen([lcap, "ui", "--db", str(db), "--port", str(args.port)], stdout=subprocess.PIPE)
        try:
            base = f"http://127.0.0.1:{args.port}"
            with httpx.Client(base_url=base, timeout=120) as c:
                for _ in range(100):
                    try:
                        cold = c.get(PAGES["first page (newest first)"])
                        break
                    except httpx.ConnectError:
                        time.sleep(0.1)
                else:
                    raise SystemExit("lcap ui did not start")
                count = re.search(r"([\d,]+) episodes? match", cold.text)
                print(f"episodes listed: {count.group(1) if count else '?'}")
                print(f"cold first page: server {server_ms(cold).get('total', 0):.0f} ms")
                print(f"{'page':70s} {'server ms median (max)':>24s} {'db ms':>7s} {'wall ms':>8s}")
                for name, path in PAGES.items():
                    runs = []
                    for _ in range(args.rounds):
                        t0 = time.perf_counter()
                        answer = c.get(path)
                        wall = (time.perf_counter() - t0) * 1000
                        assert answer.status_code == 200, (path, answer.status_code)
                        runs.append((server_ms(answer), wall))
                    total = [r[0]["total"] for r in runs]
                    db_ms = statistics.median(r[0]["db"] for r in runs)
                    wall_ms = statistics.median(r[1] for r in runs)
                    print(
                        f"{name:70s} {statistics.median(total):>14.0f} ({max(total):>5.0f}) {db_ms:>7.0f} {wall_ms:>8.0f}"
                    )
                for name, path in OTHERS.items():
                    walls = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        assert c.get(path).status_code == 200, path
                        walls.append((time.perf_counter() - t0) * 1000)
                    print(f"{name + ' (wall, median of 3)':70s} {'':>24s} {'':>7s} {statistics.median(walls):>8.0f}")
            print("target: first page <= 500 ms server time on 1,000,000 turns")
        finally:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
