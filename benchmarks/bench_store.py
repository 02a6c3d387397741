"""CPU per unit of work on the store: a DuckDB started per unit of work vs lcap's attach to a kept instance.

    .venv/bin/python benchmarks/bench_store.py [--n 40]

Both sides do the same unit of work on the same file, interleaved: open it, update one episode
row, release it. `duckdb.connect(path)` starts a DuckDB instance each time (what `Store` did
before); `Store` attaches the file to one in-memory DuckDB kept for the process and detaches it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import duckdb

from lcap.store import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=40, help="units of work per side")
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp(prefix="lcap-bench-store-")) / "lcap.duckdb"
    store = Store(path)
    store.start_episode("e", command="x", cwd="/", labels={})
    update = "UPDATE episodes SET status = 'ok' WHERE episode_id = 'e'"

    def started() -> None:
        con = duckdb.connect(str(path))
        con.execute(update)
        con.close()

    def attached() -> None:
        store.execute(update)

    cpu = {"duckdb.connect per unit": 0.0, "Store (attach/detach)": 0.0}
    for _ in range(args.n):
        for name, unit in zip(cpu, (started, attached)):
            t0 = time.process_time()
            unit()
            cpu[name] += time.process_time() - t0
    for name, seconds in cpu.items():
        print(f"{name:<26} {seconds / args.n * 1000:6.1f} ms CPU per unit of work")
    first, second = cpu.values()
    print(f"ratio: {first / second:.1f}x")


if __name__ == "__main__":
    main()
