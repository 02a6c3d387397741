"""The turn writer's batches against one insert per turn, side by side in one run.

    .venv/bin/python benchmarks/bench_writer_batch.py [--turns 500] [--rounds 3]

Spools TURNS finished calls once (bench_proxy.capture_call: a rerouted 8 KB chat call each, sealed as the
proxy seals them), then stores them into a fresh store file per path and round, the paths in a new random
order each round:
- batches: what the writer process does, `store_entries` (capture/storage/batch.py) on batches of up to
  `BATCH_RECORDS` records: one attach and one insert per batch;
- one insert per turn: each record unsealed, built into its row and inserted alone with `Store.append`, so
  one attach and one insert per turn;
- one insert per turn, one attach: the same inserts inside one attach for the whole run, which says how much
  of the difference is the attach and how much the insert.
Each path does the same work per record (unseal, `build_row`, insert); the store's schema is created, and a
first turn inserted elsewhere, before the clock starts. Printed per round: turns per second (wall) and CPU per
turn; then the medians and the ratios against batches.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import Sink, capture_call

from lcap.capture.storage.batch import store_entries
from lcap.capture.storage.spool import Entry, SpoolAppender, SpoolReader, unseal
from lcap.capture.storage.writer import BATCH_RECORDS
from lcap.capture.turns.turn import build_row
from lcap.store import Store


def spooled(root: Path, turns: int) -> tuple[Path, SpoolAppender, list[Entry]]:
    directory = root / "spool" / "bench"
    spool = SpoolAppender(directory, root / "unused.duckdb")
    call = capture_call(Sink(spool.append))
    for _ in range(turns):
        call()
    spool.close()
    return directory, spool, SpoolReader(directory).read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=500, help="turns each path stores per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lcap-bench-batch-"))
    directory, spool, entries = spooled(root, args.turns)
    cipher = spool.cipher

    def batches(store: Store) -> None:
        for start in range(0, len(entries), BATCH_RECORDS):
            store_entries(store, directory, entries[start : start + BATCH_RECORDS], cipher, only_new=False)

    def per_turn(store: Store) -> None:
        for entry in entries:
            store.append("turns", [build_row(unseal(cipher, entry.payload))])

    def per_turn_one_attach(store: Store) -> None:
        with store.connect():
            per_turn(store)

    paths: dict[str, Callable[[Store], None]] = {
        "batches": batches,
        "one insert per turn": per_turn,
        "one insert per turn, one attach": per_turn_one_attach,
    }
    rate: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    warm = Store(root / "warm-up.duckdb")  # the first insert of a process imports pyarrow
    warm.append("turns", [build_row(unseal(cipher, entries[0].payload))])
    print(f"{args.turns} turns per path per round; batches of up to {BATCH_RECORDS} records")
    print(f"{'round':>5} {'path':<34} {'turns/s':>9} {'CPU ms/turn':>12}")
    for number in range(args.rounds):
        order = list(paths)
        random.shuffle(order)
        for name in order:
            store = Store(root / f"{number}-{order.index(name)}.duckdb")
            with store.connect():
                pass
            t0, c0 = time.perf_counter(), time.process_time()
            paths[name](store)
            wall, used = time.perf_counter() - t0, time.process_time() - c0
            (stored,) = store.fetchall("SELECT count(*) FROM turns")[0]
            assert stored == args.turns, (name, stored)
            rate[name].append(args.turns / wall)
            cpu[name].append(used / args.turns * 1000)
            print(f"{number:>5} {name:<34} {rate[name][-1]:>9,.0f} {cpu[name][-1]:>12.2f}", flush=True)
    print("medians:")
    base = statistics.median(rate["batches"])
    base_cpu = statistics.median(cpu["batches"])
    for name in paths:
        r, c = statistics.median(rate[name]), statistics.median(cpu[name])
        print(
            f"  {name:<34} {r:>9,.0f} turns/s {c:>7.2f} ms CPU/turn; "
            f"batches store {base / r:.1f}x as many turns/s on {base_cpu / c:.2f}x the CPU per turn"
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
