"""What `gc.freeze()` saves a running `lcap proxy`: one full garbage collection, before and after.

    .venv/bin/python benchmarks/bench_gc_freeze.py

Starts the capture proxy in this process (mitmproxy, the front, lcap's CA: what `lcap proxy` loads),
sends a few calls through it to bench_proxy.py's upstream so every lazy import has happened, then
times full collections (the median of 5) while the start-up objects are in the collector's sight,
and again after `gc.freeze()` (as `lcap proxy` does once it is up, capture/run.py) and 200 more calls. A full
collection stops every call in flight for as long as it takes.
"""

from __future__ import annotations

import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_proxy import UPSTREAM

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store


def _full_collection_ms(repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    upstream = subprocess.Popen(
        [sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        up_url = f"http://127.0.0.1:{int(upstream.stdout.readline())}"
        proxy = CaptureProxy(
            Store(Path(tempfile.mkdtemp(prefix="lcap-gc-")) / "gc.duckdb"), ProxyOptions(upstream=up_url)
        )
        proxy.start()
        try:
            with httpx.Client(proxy=proxy.proxy_url("gc"), trust_env=False) as client:

                def calls(n: int) -> None:
                    for _ in range(n):
                        client.post(
                            f"{up_url}/v1/chat/completions", json={"model": "m", "messages": []}
                        ).raise_for_status()

                calls(20)
                tracked, before = len(gc.get_objects()), _full_collection_ms()
                gc.freeze()
                calls(200)  # what a running proxy has in sight after the freeze: what its calls made
                after_tracked, after = len(gc.get_objects()), _full_collection_ms()
            print(
                f"objects in the collector's sight: {tracked} before gc.freeze(), {after_tracked} after it and 200 calls"
            )
            print(f"one full collection: {before:.1f} ms before, {after * 1000:.0f} us after")
        finally:
            gc.unfreeze()
            proxy.stop()
    finally:
        upstream.kill()


if __name__ == "__main__":
    main()
