"""The c=16 tail of `lcap proxy` alone against direct, from many samples: is a p99 lcap's, or the machine's?

    .venv/bin/python benchmarks/tail_proxy.py [--rounds 1000] [--https] [--stream]

bench_proxy.py runs nine paths, so each gets a few thousand c=16 samples spread over minutes, and
bursts of machine noise that slow whole rounds of 16 move its p99 by 10-30 ms. This one runs three
paths only, in a new random order each round: direct, direct again (a second client on the same path:
the A/A noise), and `lcap proxy --serve --upstream` (plain HTTP, or with --https api.openai.com through
TLS interception, against the same upstream served over TLS). It prints p50, p99 and p99.9 of each, and
how many rounds were slow as a whole (median over twice the path's p50): bursts hit every path alike;
a stall of lcap's own would give lcap more of them, or a tail the direct paths do not have.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from bench_proxy import LCAP, UPSTREAM, _leaf_files, _measure, _pct, episode_proxy, start_proxy

CONCURRENCY = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000, help="rounds of 16 concurrent requests per path")
    parser.add_argument("--https", action="store_true", help="HTTPS to api.openai.com through lcap, direct over TLS")
    parser.add_argument("--stream", action="store_true", help="time to the first SSE chunk instead of whole answers")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="lcap-tail-"))
    home = os.environ.get("LCAP_HOME", str(Path.home() / ".lcap"))
    procs: list[subprocess.Popen] = []
    try:
        upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)
        procs.append(upstream)
        up_url = f"http://127.0.0.1:{int(upstream.stdout.readline())}"
        proxy, lcap_port, bundle = start_proxy(
            [LCAP, "proxy", "--serve", "--upstream", up_url, "--db", str(tmp / "tail.duckdb")],
            {**os.environ, "LCAP_HOME": home},
        )
        procs.append(proxy)
        lcap_proxy = episode_proxy(lcap_port, "tail", {**os.environ, "LCAP_HOME": home})
        direct_url = lcap_url = f"{up_url}/v1/chat/completions"
        if args.https:
            secure = subprocess.Popen(
                [sys.executable, "-c", UPSTREAM, *_leaf_files(Path(home) / "ca", tmp)],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(secure)
            direct_url = f"https://127.0.0.1:{int(secure.stdout.readline())}/v1/chat/completions"
            lcap_url = "https://api.openai.com/v1/chat/completions"

        async def run() -> dict[str, list[float]]:
            limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
            ctx = ssl.create_default_context(cafile=bundle)

            def client(**kwargs) -> httpx.AsyncClient:
                return httpx.AsyncClient(limits=limits, trust_env=False, timeout=60, verify=ctx, **kwargs)

            clients = {
                "direct": (client(), direct_url),
                "direct again": (client(), direct_url),
                "lcap": (client(proxy=lcap_proxy), lcap_url),
            }
            try:
                results, _ = await _measure(clients, concurrency=CONCURRENCY, rounds=args.rounds, stream=args.stream)
            finally:
                for c, _ in clients.values():
                    await c.aclose()
            return results

        results = asyncio.run(run())
        proxy.send_signal(signal.SIGINT)
        proxy.wait(120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    what = (
        f"{'https' if args.https else 'http'}, {'first SSE chunk' if args.stream else 'whole answer'}, c={CONCURRENCY}"
    )
    print(f"{what}, {args.rounds} rounds per path")
    print(
        f"{'path':<14}{'n':>7}{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}{'+p50':>8}{'+p99':>8}{'+p99.9':>8}{'slow rounds':>13}"
    )
    base = results["direct"]
    for name, values in results.items():
        p50, p99, p999 = _pct(values, 0.5), _pct(values, 0.99), _pct(values, 0.999)
        rounds = [sorted(values[i : i + CONCURRENCY]) for i in range(0, len(values), CONCURRENCY)]
        slow = sum(r[CONCURRENCY // 2] > 2 * p50 for r in rounds)
        added = (
            ""
            if name == "direct"
            else (f"{p50 - _pct(base, 0.5):>+8.2f}{p99 - _pct(base, 0.99):>+8.2f}{p999 - _pct(base, 0.999):>+8.2f}")
        )
        print(f"{name:<14}{len(values):>7}{p50:>9.2f}{p99:>9.2f}{p999:>10.2f}{added:>24}{slow:>13}")


if __name__ == "__main__":
    main()
