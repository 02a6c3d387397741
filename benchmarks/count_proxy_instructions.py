"""Instructions a proxy process executes per proxied call, counted by callgrind: immune to machine noise.

    .venv/bin/python benchmarks/count_proxy_instructions.py [--n 200]

Needs valgrind (`apt-get install valgrind`). Three proxies, each run under callgrind with
instrumentation off until 20 warm-up calls are done, then on for N plain-HTTP chat completions
through the proxy to bench_proxy.py's minimal upstream:
- stock mitmproxy with the three addons lcap loads and a reroute-only addon;
- the same with lcap's `skip_debug_checks()`;
- `lcap proxy --serve`, its front's short path (capture and spool included; its writer process is
  not counted: valgrind does not follow children, and that work is off the proxy's process by design).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proxy import BARE, LCAP, REQUEST, REROUTE, UPSTREAM, episode_proxy


def count(argv: list[str], env: dict[str, str], port_of, upstream: str, n: int, out: Path) -> int:
    """Run `argv` under callgrind; return the instructions of N calls through it (after 20 uncounted)."""
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        port = port_of(proc.stdout.readline())
        with httpx.Client(proxy=episode_proxy(port, env=env), trust_env=False, timeout=120) as client:
            url = f"{upstream}/v1/chat/completions"
            for _ in range(20):
                client.post(url, json=REQUEST).raise_for_status()
            subprocess.run(["callgrind_control", "--instr=on", str(proc.pid)], check=True, capture_output=True)
            for _ in range(n):
                client.post(url, json=REQUEST).raise_for_status()
            subprocess.run(["callgrind_control", "--instr=off", str(proc.pid)], check=True, capture_output=True)
            subprocess.run(["callgrind_control", "--dump", str(proc.pid)], check=True, capture_output=True)
    finally:
        proc.kill()
        proc.wait()
    dumps = sorted(out.parent.glob(f"{out.name}.{proc.pid}*"), key=os.path.getmtime)
    total = 0
    for dump in dumps:
        totals = re.search(r"^totals: (\d+)", dump.read_text(errors="replace"), re.M)
        total += int(totals.group(1)) if totals else 0
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="counted calls per proxy")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    tmp = Path(tempfile.mkdtemp(prefix="lcap-icount-"))
    home = os.environ.get("LCAP_HOME", str(Path.home() / ".lcap"))
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)
    try:
        up_port = int(upstream.stdout.readline())
        up_url = f"http://127.0.0.1:{up_port}"
        (tmp / "reroute.py").write_text(REROUTE)
        env = {**os.environ, "LCAP_HOME": home, "BENCH_UPSTREAM_PORT": str(up_port)}
        bare = [sys.executable, "-c", BARE, str(tmp / "reroute.py"), str(Path(home) / "ca")]
        rows = [
            ("stock mitmproxy, lcap's 3 addons", bare, env, int),
            ("  + skip_debug_checks()", bare, {**env, "BENCH_SKIP_DEBUG_CHECKS": "1"}, int),
            (
                "lcap proxy --serve",
                [sys.executable, LCAP, "proxy", "--serve", "--upstream", up_url, "--db", str(tmp / "db.duckdb")],
                env,
                lambda line: int(line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)[1]),
            ),
        ]
        print(f"{'proxy':<36}{'instructions per call':>24}")
        for label, argv, row_env, port_of in rows:
            t0 = time.perf_counter()
            total = count(argv, row_env, port_of, up_url, args.n, tmp / "cg")
            print(f"{label:<36}{total / args.n / 1e6:>22.2f} M   ({time.perf_counter() - t0:.0f} s under valgrind)")
    finally:
        upstream.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
