"""How long a process waits for the store beside a writer with a backlog, with the waiters let in first and without.

    .venv/bin/python benchmarks/bench_store_waiters.py [--seconds 20] [--batch 100] [--repeats 2]

Two processes on one store file, as `lcap collect` runs them: a writer appending batches of BATCH turns (about 5 KB
each) back to back, as the turn writer does with a backlog, and a driver that attaches the store for one episode row
every 50 ms, as a collect's driver starts and records episodes. Each run lasts SECONDS; runs alternate between the
store as it is (`lcap.store._Waiters`: a process about to attach lets those waiting in first) and the same with that
step removed in both processes (DuckDB's lock alone, which is no queue). Printed per run: the driver's attaches and
their waits (median, 90th and 99th percentile, longest) and the writer's turns stored.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from pathlib import Path


def _setup(queue: bool) -> None:
    if not queue:
        import lcap.store

        lcap.store._Waiters.let_in = lambda self: None  # type: ignore[method-assign]


def _turn(i: int) -> dict:
    return {
        "turn_id": f"t{i}-{random.random()}",
        "episode_id": f"e{i % 500}",
        "seq": i,
        "host": "api.openai.com",
        "path": "/v1/chat/completions",
        "dialect": "chat",
        "request": json.dumps({"messages": os.urandom(2000).hex()}),
        "response": json.dumps({"choices": os.urandom(500).hex()}),
        "status_code": 200,
    }


def writer(db: str, batch: int, queue: bool, stop, out) -> None:
    _setup(queue)
    from lcap.store import Store

    store, stored = Store(db), 0
    while not stop.is_set():
        store.append("turns", [_turn(stored + k) for k in range(batch)])
        stored += batch
    out.put(stored)


def driver(db: str, queue: bool, stop, out) -> None:
    _setup(queue)
    from lcap.store import Store

    store, waits = Store(db), []
    while not stop.is_set():
        t0 = time.perf_counter()
        with store.connect():
            waits.append(time.perf_counter() - t0)
            store.start_episode(f"d{len(waits)}", command="agent", cwd="/", labels={})
        time.sleep(0.05)
    out.put(waits)


def run(seconds: float, batch: int, queue: bool) -> tuple[list[float], int]:
    db = str(Path(tempfile.mkdtemp(prefix="lcap-bench-waiters-")) / "lcap.duckdb")
    stop, waits, stored = mp.Event(), mp.Queue(), mp.Queue()
    w = mp.Process(target=writer, args=(db, batch, queue, stop, stored))
    d = mp.Process(target=driver, args=(db, queue, stop, waits))
    w.start()
    time.sleep(2)  # the writer's backlog under way
    d.start()
    time.sleep(seconds)
    stop.set()
    result = sorted(waits.get()), stored.get()
    w.join()
    d.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batch", type=int, default=100, help="turns per writer batch")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    mp.set_start_method("spawn")
    print(f"writer batches of {args.batch} turns back to back; a driver attaching every 50 ms; {args.seconds:g} s runs")
    print(
        f"{'store':<20} {'attaches':>9} {'median ms':>10} {'p90 ms':>7} {'p99 ms':>7} {'max ms':>7} {'turns stored':>13}"
    )
    for _ in range(args.repeats):
        for queue in (False, True):
            waits, stored = run(args.seconds, args.batch, queue)
            p = lambda q: waits[min(len(waits) - 1, int(q * len(waits)))] * 1000  # noqa: E731
            name = "waiters let in" if queue else "DuckDB's lock alone"
            print(
                f"{name:<20} {len(waits):>9} {statistics.median(waits) * 1000:>10.0f} {p(0.9):>7.0f} {p(0.99):>7.0f} "
                f"{waits[-1] * 1000:>7.0f} {stored:>13,}",
                flush=True,
            )


if __name__ == "__main__":
    main()
