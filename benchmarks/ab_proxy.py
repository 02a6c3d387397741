"""Two revisions of `lcap proxy` side by side: does a change to the capture path make calls faster?

    .venv/bin/python benchmarks/ab_proxy.py --base REV [--n 2000] [--rounds 120]

The working tree and REV (checked out in a temporary git worktree) each run `lcap proxy --serve --upstream`
in front of bench_proxy's upstream; an httpx client calls https://api.openai.com through each (CONNECT +
TLS interception) and the upstream directly, in a new random order each round, so the machine's noise hits
all three alike. Cases: c=1 (n calls per path) and c=16 (rounds of 16 at once), streaming (time to the first
SSE chunk) and not. The full comparison against every baseline is bench_proxy.py; this one answers a narrower
question with more samples, since differences between revisions are often below the noise between runs.
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
import tomllib
from pathlib import Path

import httpx
from bench_proxy import LCAP, REPO, UPSTREAM, _measure, _pct, episode_proxy, start_proxy


def _checkout(rev: str, into: Path) -> Path:
    """REV's `lcap` package, laid out as installed (lcap/, lcap/capture/, ...), for PYTHONPATH."""
    tree = into / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    pkg = into / "pkg"
    folders = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(folders.items()):  # lcap first, then lcap.capture, ... in their folders
        shutil.copytree(tree / folder, pkg.joinpath(*package.split(".")))
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)
    return pkg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare the working tree with")
    parser.add_argument("--n", type=int, default=2000, help="calls per path at concurrency 1")
    parser.add_argument("--rounds", type=int, default=120, help="rounds of 16 concurrent calls per path")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="lcap-ab-"))
    procs: list[subprocess.Popen] = []
    try:
        base_pkg = _checkout(args.base, tmp / "base")
        upstream = subprocess.Popen(
            [sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        procs.append(upstream)
        up_url = f"http://127.0.0.1:{int(upstream.stdout.readline())}"
        serve = ["proxy", "--serve", "--upstream", up_url, "--db"]
        base_env = {**os.environ, "PYTHONPATH": str(base_pkg)}
        base, base_port, bundle = start_proxy(
            [sys.executable, "-c", "from lcap.cli import app; app()", *serve, str(tmp / "base.duckdb")],
            base_env,
            base_pkg,
        )
        procs.append(base)
        work, work_port, _ = start_proxy([LCAP, *serve, str(tmp / "work.duckdb")], dict(os.environ), tmp)
        procs.append(work)

        async def run() -> list[tuple[str, dict[str, list[float]]]]:
            ctx = ssl.create_default_context(cafile=bundle)
            limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
            https = "https://api.openai.com/v1/chat/completions"
            paths = {
                "direct": (httpx.AsyncClient(trust_env=False, limits=limits), f"{up_url}/v1/chat/completions"),
                f"base {args.base}": (
                    httpx.AsyncClient(trust_env=False, limits=limits, verify=ctx, proxy=episode_proxy(base_port, "ab")),
                    https,
                ),
                "working tree": (
                    httpx.AsyncClient(trust_env=False, limits=limits, verify=ctx, proxy=episode_proxy(work_port, "ab")),
                    https,
                ),
            }
            rows = []
            for label, concurrency, calls, stream in (
                ("non-streaming c=1", 1, args.n, False),
                ("first SSE chunk c=1", 1, args.n, True),
                ("non-streaming c=16", 16, args.rounds, False),
                ("first SSE chunk c=16", 16, args.rounds, True),
            ):
                latencies, _ = await _measure(paths, concurrency=concurrency, rounds=calls, stream=stream)
                rows.append((label, latencies))
            for client, _ in paths.values():
                await client.aclose()
            return rows

        rows = asyncio.run(run())
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)  # the proxies write their turns and exit
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{'case':<22}{'path':<22}{'n':>6}{'p50 ms':>9}{'+p50':>8}{'+p90':>8}{'+p99':>8}")
    for label, res in rows:
        direct = res["direct"]
        for name, values in res.items():
            added = (
                ""
                if name == "direct"
                else "".join(f"{_pct(values, q) - _pct(direct, q):>+8.2f}" for q in (0.5, 0.9, 0.99))
            )
            print(f"{label:<22}{name:<22}{len(values):>6}{_pct(values, 0.5):>9.2f}{added}")


if __name__ == "__main__":
    main()
