"""Benchmark `build_dataset` on a synthetic store (default 1,000,000 turns); target <= 30 s.

    .venv/bin/python benchmarks/bench_build_dataset.py [--turns N] [--keep]

Generates the store with benchmarks/synthetic_store.py (4-turn episodes, groups of 8, every
10th episode non-mergeable, ~1% truncated), then times build-dataset end to end: the SQL views
(dedup, rewards, advantages, prefix-checked merge), the Parquet write and the report.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from synthetic_store import make_store

from lcap.dataset.build.builder import build_dataset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=1_000_000)
    ap.add_argument("--dir", type=Path, default=None, help="where to put the store and output (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        store = make_store(root / "bench.duckdb", turns=args.turns)
        gen = time.perf_counter() - t0
        print(
            f"generated {args.turns:,} turns in {gen:.1f}s ({(root / 'bench.duckdb').stat().st_size / 2**20:.0f} MiB)"
        )
        t0 = time.perf_counter()
        report = build_dataset(store, round=1, out=root / "data")
        took = time.perf_counter() - t0
        print("\n".join(report.lines()))
        size = (root / "data" / "samples.parquet").stat().st_size / 2**20
        print(
            f"build-dataset: {args.turns:,} turns in {took:.1f}s = {args.turns / took:,.0f} turns/s "
            f"(target <= 30 s for 1,000,000); samples.parquet {size:.0f} MiB"
        )


if __name__ == "__main__":
    main()
