"""The proxy's SSE cut is linear in the stream: one giant event, sent in small chunks, costs in proportion to its size.

    .venv/bin/python benchmarks/bench_sse.py [--sizes 12,24,48] [--chunk 65536] [--rounds 3]

Feeds one `data:` event of each size (MiB) in chunks of `--chunk` bytes through the policy route's event splitter
(`SseParts`, which the `--token-ids` rewriter shares its cut with: `capture/turns/sse.py`), CRLF line ends, and
prints the median seconds per size and the ratio to the previous size (linear: about the size ratio; a buffer grown
by appends and searched from its start each time: about its square).
"""

from __future__ import annotations

import argparse
import statistics
import time

from lcap.capture.routing.policy_wire import SseParts


def feed(size: int, chunk: int) -> float:
    event = b"data: " + b"x" * size + b"\r\n\r\n"
    parts = SseParts(lambda record, head: None, limit=1 << 40)
    start = time.perf_counter()
    out = []
    for at in range(0, len(event), chunk):
        out += parts(event[at : at + chunk])
    out += parts(b"")
    elapsed = time.perf_counter() - start
    assert b"".join(out) == event
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="12,24,48", help="event sizes in MiB, comma-separated")
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) << 20 for s in args.sizes.split(",")]
    times: dict[int, list[float]] = {s: [] for s in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            times[size].append(feed(size, args.chunk))
    previous: tuple[float, int] | None = None
    for size in sizes:
        median = statistics.median(times[size])
        ratio = f"  x{median / previous[0]:.1f} for x{size / previous[1]:.0f} the size" if previous else ""
        print(f"{size >> 20:4d} MiB event in {args.chunk} B chunks: {median:.3f} s{ratio}")
        previous = (median, size)


if __name__ == "__main__":
    main()
