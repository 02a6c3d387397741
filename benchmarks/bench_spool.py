"""The spool and writer process against the proxy storing each turn itself, side by side in one run.

    .venv/bin/python benchmarks/bench_spool.py [--calls 600] [--rounds 4]

Each path takes CALLS finished calls back to back from lcap's own call handling (bench_proxy.capture_call: a
rerouted 8 KB chat call each, the proxy's work without the network), into a fresh store file per path and
round, the paths in a new random order each round:
- spool + writer process: lcap's `TurnWriter` (capture/storage/writer.py): the call's turn sealed and
  appended to the spool, the writer process storing it in batches;
- insert in the proxy: the call's turn built into its row and inserted with `Store.append` right there, in
  the proxy's process, before the call is done;
- a thread in the proxy: the turn queued for a thread of the proxy's process that builds the rows and inserts
  them in batches (what lcap did before the writer process);
- nothing stored: the turn dropped, the floor under the proxy's times.
Each path runs twice a round: its calls back to back (the turns per second from the first call to the last turn
in the store; the CPU per turn in the proxy's process and in the writer process, its start-up left out), then
one call due every EVERY seconds while the turns are stored. Printed per round and as medians: the proxy's
time per call (p50, p99: what its event loop pays, from when the call could start, due and the call before it
done, to its turn handed over) both ways, turns/s and CPU. Storing in the proxy cannot keep any useful pace, so
its back-to-back times stand for its paced ones. The writer process runs at nice 10, as lcap starts it: on a
busy machine it gets the CPU last.
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import Sink, _pct, capture_call
from machine import proc_stat

from lcap.capture.storage.writer import BATCH_RECORDS, TurnWriter
from lcap.capture.turns.turn import PendingTurn, build_row
from lcap.store import Store


@dataclass
class Run:
    per_call: list[float]  # us
    turns_per_s: float
    proxy_cpu: float  # ms per turn
    writer_cpu: float  # ms per turn


def _calls(sink: Any, n: int, every: float) -> tuple[list[float], float, float]:
    """`n` calls into `sink`, one due every `every` seconds (0: back to back): each one's time (us) from when it
    could start (it was due and the call before it was done) to its end, and when the first started (wall and
    CPU clocks)."""
    call = capture_call(sink)
    times = []
    t0, c0 = time.perf_counter(), time.process_time()
    done = t0
    for i in range(n):
        due = t0 + i * every
        if due > time.perf_counter():
            time.sleep(due - time.perf_counter())
        call()
        end = time.perf_counter()
        times.append((end - max(due, done)) * 1e6)
        done = end
    return times, t0, c0


def nothing_stored(store: Store, root: Path, n: int, every: float) -> Run:
    times, t0, c0 = _calls(Sink(lambda turn: None), n, every)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Run(times, n / wall, cpu / n * 1000, 0.0)


def spool_and_writer(store: Store, root: Path, n: int, every: float) -> Run:
    writer = TurnWriter(store, spool_root=root / "spool")
    writer.start()
    writer.flush()  # the writer process is up
    pid = writer.counters()["writer_pid"]
    assert isinstance(pid, int)
    before = proc_stat(pid).cpu
    times, t0, c0 = _calls(writer, n, every)
    proxy_cpu = time.process_time() - c0
    assert writer.flush(timeout=600)
    wall = time.perf_counter() - t0
    writer_cpu = proc_stat(pid).cpu - before
    assert writer.stop()
    return Run(times, n / wall, proxy_cpu / n * 1000, writer_cpu / n * 1000)


def insert_in_proxy(store: Store, root: Path, n: int, every: float) -> Run:
    times, t0, c0 = _calls(Sink(lambda turn: store.append("turns", [build_row(turn)])), n, every)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Run(times, n / wall, cpu / n * 1000, 0.0)


def thread_in_proxy(store: Store, root: Path, n: int, every: float) -> Run:
    queue: collections.deque[PendingTurn] = collections.deque()
    ready = threading.Event()
    stored = 0

    def work() -> None:
        nonlocal stored
        while stored < n:
            ready.wait()
            ready.clear()
            while queue:
                batch = [queue.popleft() for _ in range(min(len(queue), BATCH_RECORDS))]
                stored += store.append("turns", [build_row(turn) for turn in batch])

    def put(turn: PendingTurn) -> None:
        queue.append(turn)
        ready.set()

    thread = threading.Thread(target=work)
    thread.start()
    times, t0, c0 = _calls(Sink(put), n, every)
    thread.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Run(times, n / wall, cpu / n * 1000, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=600, help="calls per path per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--every", type=float, default=0.001, help="seconds between paced calls")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lcap-bench-spool-"))
    paths: dict[str, Callable[[Store, Path, int, float], Run]] = {
        "spool + writer process": spool_and_writer,
        "insert in the proxy": insert_in_proxy,
        "a thread in the proxy": thread_in_proxy,
        "nothing stored": nothing_stored,
    }
    runs: dict[str, list[Run]] = {name: [] for name in paths}
    paced: dict[str, list[list[float]]] = {name: [] for name in paths}
    for name, path in paths.items():  # imports and first-call work out of the rounds
        path(Store(root / f"warm-up-{len(name)}.duckdb"), root, 20, 0)
    print(f"{args.calls} calls per path per round, back to back, then one due every {args.every * 1000:g} ms")
    print(f"{'round':>5} {HEADER}")
    stores = iter(range(1 << 30))

    def fresh() -> Store:
        store = Store(root / f"{next(stores)}.duckdb")
        with store.connect():
            pass
        return store

    for number in range(args.rounds):
        order = list(paths)
        random.shuffle(order)
        for name in order:
            store = fresh()
            run = paths[name](store, root, args.calls, 0)
            (stored,) = store.fetchall("SELECT count(*) FROM turns")[0]
            assert stored == (0 if name == "nothing stored" else args.calls), (name, stored)
            runs[name].append(run)
            # Storing in the proxy cannot keep pace: its calls are back to back anyway.
            paced[name].append(
                run.per_call
                if name == "insert in the proxy"
                else paths[name](fresh(), root, args.calls, args.every).per_call
            )
            print(f"{number:>5} {_line(name, [run], paced[name][-1:])}", flush=True)
    print(f"medians of {args.rounds} rounds:")
    print(f"      {HEADER}")
    for name in paths:
        print(f"      {_line(name, runs[name], paced[name])}")
    m = statistics.median
    spool, spool_paced = runs["spool + writer process"], paced["spool + writer process"]
    for name in list(paths)[1:3]:
        other, other_paced = runs[name], paced[name]
        print(
            f"{name} / spool + writer process: the proxy's time per call, paced, "
            f"{m(_pct(t, 0.5) for t in other_paced) / m(_pct(t, 0.5) for t in spool_paced):.2f}x at p50, "
            f"{m(_pct(t, 0.99) for t in other_paced) / m(_pct(t, 0.99) for t in spool_paced):.2f}x at p99; "
            f"the proxy's CPU per turn {m(r.proxy_cpu for r in other) / m(r.proxy_cpu for r in spool):.1f}x; "
            f"turns/s {m(r.turns_per_s for r in other) / m(r.turns_per_s for r in spool):.2f}x"
        )
    shutil.rmtree(root, ignore_errors=True)


HEADER = (
    f"{'path':<24} {'p50 us':>8} {'p99 us':>9} {'paced p50':>10} {'paced p99':>10} {'turns/s':>8} "
    f"{'proxy CPU ms/turn':>18} {'writer CPU':>11}"
)


def _line(name: str, runs: list[Run], paced: list[list[float]]) -> str:
    m = statistics.median
    return (
        f"{name:<24} {m(_pct(r.per_call, 0.5) for r in runs):>8.0f} {m(_pct(r.per_call, 0.99) for r in runs):>9.0f} "
        f"{m(_pct(t, 0.5) for t in paced):>10.0f} {m(_pct(t, 0.99) for t in paced):>10.0f} "
        f"{m(r.turns_per_s for r in runs):>8,.0f} {m(r.proxy_cpu for r in runs):>18.2f} "
        f"{m(r.writer_cpu for r in runs):>11.2f}"
    )


if __name__ == "__main__":
    main()
