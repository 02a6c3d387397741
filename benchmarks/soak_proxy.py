"""Soak: 64 concurrent agents through `lcap proxy --serve` for minutes, with faults injected; exits 1 if a check fails.

    .venv/bin/python benchmarks/soak_proxy.py [--duration 240] [--agents 64] [--slowloris 1500] [--proxy-nofile 1024]

Issue #14, requirement 11. An upstream in a subprocess (asyncio, on uvloop) streams chat completions
(8 SSE events, 5 ms apart) and records every call it receives. Agents, in this process, call it
through the proxy in a loop (half over HTTPS to api.openai.com, rerouted; half over plain HTTP; a
new client every 10 calls), each call named in its query string (`?soak=ROLE-AGENT-N`), which the
store keeps in `turns.path`. Roles:

- stream (all agents but five): streamed calls; whole (2): non-streamed calls;
- hang (1): the upstream never answers, the agent gives up after 3 s (an error turn is due);
- reset (1): the upstream resets the connection after two events (an error turn is due);
- oversize (1): every `--oversize-every` s, a chat call with a `--oversize-mb` MB body and a real
  Content-Length (a turn is due: the answer, or a refusal with 413 and an error turn).

Faults on a timeline (fractions of `--duration`): slowloris from 20% to 60% (`--slowloris`
connections from 127.0.0.2 sending a head or a body one line every 5 s; the proxy's open-file
limit is set to `--proxy-nofile` so that they can exhaust it, and its head and body timeouts to
`--head-timeout` and `--body-timeout`, shorter than its defaults, so that they meet them within
the run), the store held by another process (DuckDB's file lock) for `--lock-seconds` from 15%,
kill -9 of the turn writer at 40% and 75%.

Printed: per role, calls sent, answered in full, refused by the proxy (shed with 503 included),
failed on the agent's side, received by the upstream and stored; the proxy's RSS and open fds
idle before the load and `--settle` seconds after it (and the peak); what the proxy did with the
slowloris connections; its own exit report. Checks (any failure exits 1): every call the upstream
received is stored (per role); every call the proxy refused with a 408 or 413 is stored; no stream
or whole call failed other than shed with a 503; a writer runs at the end and nothing is left in
the spool; no slowloris connection outlived the proxy's timeout for it by 10 s (those opened too
late in the window to meet it are counted apart, and must be under half); fds and RSS back near
idle (the fds over idle are listed by kind); no "Task
was destroyed but it is pending!"; the proxy exits 0. The capture-overhead targets are checked by
benchmarks/bench_proxy.py, not here.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import re
import resource
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_proxy import LCAP, start_proxy
from machine import cmdline, processes

UPSTREAM = r"""
import asyncio, json, socket, struct, sys
from collections import defaultdict
from urllib.parse import parse_qs, urlsplit

seen = defaultdict(set)
EVENT = b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"ok "},"finish_reason":null}]}\n\n'
LAST = b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
WHOLE = json.dumps({"id": "c1", "object": "chat.completion", "model": "m", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode()
MARK = b"x-soak-upstream: 1\r\n"

def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)

async def skip_body(reader, head):
    fields = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    if "chunked" in fields.get("transfer-encoding", "").lower():
        while size := int((await reader.readline()).split(b";")[0], 16):
            await reader.readexactly(size + 2)
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        return
    left = int(fields.get("content-length") or 0)
    while left:  # an oversized body is read and dropped, never held
        data = await reader.read(min(left, 1 << 20))
        if not data:
            raise ConnectionError("the body ended early")
        left -= len(data)

async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            await skip_body(reader, head)
            url = urlsplit(target)
            if method == "GET":
                if url.path == "/soak-stats":
                    data = json.dumps({role: sorted(calls) for role, calls in seen.items()}).encode()
                else:
                    data = b'{"object":"list","data":[{"id":"m","owned_by":"soak"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
                await writer.drain()
                continue
            call = (parse_qs(url.query).get("soak") or ["unnamed-0-0"])[0]
            role = call.split("-", 1)[0]
            seen[role].add(call)
            if role == "hang":  # never answer; hold the connection until the other side closes it
                while await reader.read(65536):
                    pass
                return
            if role == "whole":
                writer.write(b"HTTP/1.1 200 OK\r\n%scontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (MARK, len(WHOLE)) + WHOLE)
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\n%scontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" % MARK)
            for i in range(8):
                writer.write(chunk(EVENT))
                await writer.drain()
                if role == "reset" and i == 1:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                await asyncio.sleep(0.005)
            writer.write(chunk(LAST) + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024, limit=1 << 20)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()

try:
    from uvloop import run
except ImportError:
    run = asyncio.run
run(main())
"""

LOCK = r"""
import duckdb, sys, time
deadline = time.monotonic() + 60
while True:  # the writer holds the file while it stores a batch: wait for a moment it does not
    try:
        con = duckdb.connect(sys.argv[1])
        break
    except duckdb.IOException:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""

ROLES = ("stream", "whole", "hang", "reset", "oversize")


@dataclass
class Tally:
    """What the agents of one role saw."""

    sent: set[str] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)  # the upstream's answer, in full
    refused: Counter = field(default_factory=Counter)  # the proxy's own status codes
    refused_calls: dict[str, int] = field(default_factory=dict)
    failed: Counter = field(default_factory=Counter)  # errors on the agent's side, by kind


# --- the proxy process ------------------------------------------------------------------------------


def proc_stats(pid: int) -> tuple[float, int]:
    """RSS (MB) and open file descriptors of a process."""
    try:
        rss = next(
            int(line.split()[1]) / 1024
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return 0.0, 0


def fd_kinds(pid: int, listen_port: int) -> Counter[str]:
    """What a process's open fds are: files by path, pipes, TCP sockets by the port at the other end (an agent's
    connection when the local end is the proxy's port), so that fds not back to idle can be told apart."""
    sockets: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
                state = "listening" if fields[3] == "0A" else f"to :{remote}"
                sockets[fields[9]] = "agent connection" if local == listen_port and remote else f"socket {state}"
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                target = sockets.get(target[8:-1], "socket (not TCP)")
            elif target.startswith("pipe:"):
                target = "pipe"
            kinds[target] += 1
    return kinds


def writer_pids(proxy_pid: int) -> list[int]:
    """The proxy's turn writer processes (`python ... lcap.capture.storage.writer ...`), children of the proxy."""
    return [p.pid for p in processes() if p.ppid == proxy_pid and b"lcap.capture.storage.writer" in cmdline(p.pid)]


def episode_proxy_urls(port: int, n: int, env: dict[str, str]) -> list[str]:
    """A proxy URL per agent: minted by `lcap episode new` where lcap has it (issue #14 req 7), else one naming
    the episode as its user."""
    urls = []
    for i in range(n):
        minted = subprocess.run(
            [LCAP, "episode", "new", "--port", str(port), "--label", f"soak={i}"],
            env=env,
            capture_output=True,
            text=True,
        )
        if minted.returncode != 0:
            return [f"http://soak-{i}:x@127.0.0.1:{port}" for i in range(n)]
        urls.append(minted.stdout.strip().splitlines()[-1])
    return urls


# --- agents -----------------------------------------------------------------------------------------


async def agent(
    index: int, role: str, proxy: str, verify: ssl.SSLContext, up_url: str, deadline: float, tally: Tally, think: float
) -> None:
    """Calls in a loop until `deadline`, over HTTPS (even agents) or plain HTTP, a new client every 10 calls."""
    https = index % 2 == 0
    timeout = httpx.Timeout(3.0) if role == "hang" else httpx.Timeout(120.0)
    client: httpx.AsyncClient | None = None
    n = 0
    try:
        while time.monotonic() < deadline:
            if n % 10 == 0:
                if client is not None:
                    await client.aclose()
                client = httpx.AsyncClient(proxy=proxy, verify=verify, trust_env=False, timeout=timeout)
            assert client is not None
            call = f"{role}-{index}-{n}"
            n += 1
            base = "https://api.openai.com" if https else up_url
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"soak {call}"}]}
            body["stream"] = role != "whole"
            tally.sent.add(call)
            try:
                async with client.stream("POST", f"{base}/v1/chat/completions?soak={call}", json=body) as resp:
                    data = b"".join([piece async for piece in resp.aiter_raw()])
                if "x-soak-upstream" not in resp.headers:
                    tally.refused[resp.status_code] += 1
                    tally.refused_calls[call] = resp.status_code
                elif resp.status_code == 200 and (role == "whole" or data.endswith(b"data: [DONE]\n\n")):
                    tally.answered.add(call)
                else:
                    tally.failed[f"incomplete {resp.status_code}"] += 1
            except httpx.HTTPError as exc:
                tally.failed[exc.__class__.__name__] += 1
            await asyncio.sleep(think)
    finally:
        if client is not None:
            await client.aclose()


async def oversize_agent(
    proxy_port: int, auth: str, up_port: int, megabytes: int, every: float, start: float, deadline: float, tally: Tally
) -> None:
    """A chat call with a huge body and its real Content-Length, every `every` seconds, written 1 MB at a time."""
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    n = 0
    while time.monotonic() < deadline:
        call = f"oversize-0-{n}"
        n += 1
        tally.sent.add(call)
        head = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"'
        tail = b'"}]}'
        piece = b"x" * (1 << 20)
        length = len(head) + megabytes * len(piece) + len(tail)
        t0 = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
            writer.write(
                b"POST http://127.0.0.1:%d/v1/chat/completions?soak=%s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                b"Proxy-Authorization: Basic %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (up_port, call.encode(), up_port, auth.encode(), length, head)
            )
            early = asyncio.create_task(reader.read(65536))  # a refusal may come before the body is sent
            try:
                for _ in range(megabytes):
                    if early.done():
                        break
                    writer.write(piece)
                    await asyncio.wait_for(writer.drain(), 60)
                else:
                    writer.write(tail)
                    await writer.drain()
            except (ConnectionError, TimeoutError):
                pass  # the proxy stopped reading: its answer, if any, is in `early`
            answer = await asyncio.wait_for(early, 300)
            writer.close()
            status = int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") else None
            if b"x-soak-upstream" in answer.lower():
                tally.answered.add(call)
            elif status is not None:
                tally.refused[status] += 1
                tally.refused_calls[call] = status
            else:
                tally.failed["no answer"] += 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            tally.failed[exc.__class__.__name__] += 1
        print(f"  oversize call {call}: {time.monotonic() - t0:.1f} s", flush=True)
        await asyncio.sleep(max(0.0, every - (time.monotonic() - t0)))


@dataclass
class Slow:
    """Slowloris: connections that never finish their request."""

    opened: int = 0
    connect_failed: int = 0
    closed_by_proxy: int = 0
    answered: Counter = field(default_factory=Counter)  # status codes the proxy answered them with
    seconds_to_close: list[float] = field(default_factory=list)
    overdue: int = 0  # still open at the end, older than the proxy's timeout for them (+10 s)
    young: int = 0  # still open at the end, younger than that (opened late on a loaded machine): not judged


async def slowloris(
    port: int, up_port: int, count: int, start: float, stop: float, slow: Slow, timeouts: tuple[float, float]
) -> None:
    """`count` connections from 127.0.0.2 (another client than the agents, for per-client limits), half sending a
    head and half a body, one line or byte every 5 s, from `start` to `stop`. `timeouts`: the proxy's head and
    body timeouts, past which (+10 s) one still open at `stop` is overdue."""
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    conns: list[tuple[asyncio.StreamWriter, asyncio.Task, float]] = []

    async def watch(reader: asyncio.StreamReader, opened: float) -> None:
        try:
            data = await reader.read(65536)
        except (ConnectionError, OSError):
            data = b""
        slow.closed_by_proxy += 1
        slow.seconds_to_close.append(time.monotonic() - opened)
        if data.startswith(b"HTTP/1.1 "):
            slow.answered[int(data[9:12])] += 1

    for i in range(count):
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0)), 10
            )
        except (OSError, TimeoutError):
            slow.connect_failed += 1
            continue
        slow.opened += 1
        head = b"POST http://127.0.0.1:%d/v1/chat/completions?soak=slowloris-0-%d HTTP/1.1\r\nHost: x\r\n" % (
            up_port,
            i,
        )
        if i % 2:
            head += b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
        writer.write(head)
        opened = time.monotonic()
        conns.append((writer, asyncio.create_task(watch(reader, opened)), opened))
        if i % 100 == 99:
            await asyncio.sleep(0.1)
    n = 0
    while time.monotonic() < stop:
        await asyncio.sleep(min(5.0, max(0.0, stop - time.monotonic())))
        n += 1
        for i, (writer, watcher, _) in enumerate(conns):
            if not watcher.done():
                writer.write(b"x-slow-%d: 1\r\n" % n if i % 2 == 0 else b" ")
    for i, (writer, watcher, opened) in enumerate(conns):
        if not watcher.done():
            if time.monotonic() - opened > timeouts[i % 2] + 10:
                slow.overdue += 1
            else:
                slow.young += 1
        watcher.cancel()
        writer.close()


# --- the run ------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=240, help="seconds of load")
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--think", type=float, default=0.05, help="seconds an agent waits between calls")
    parser.add_argument("--slowloris", type=int, default=1500, help="slow connections (0: none)")
    parser.add_argument("--proxy-nofile", type=int, default=1024, help="the proxy's open-file limit")
    parser.add_argument("--oversize-mb", type=int, default=256, help="size of the oversized bodies (0: none)")
    parser.add_argument("--oversize-every", type=float, default=60)
    parser.add_argument("--lock-seconds", type=float, default=30, help="how long the store is held (0: not)")
    parser.add_argument(
        "--head-timeout",
        type=float,
        default=20,
        help="the proxy's --head-timeout (shorter than its default, so "
        "that the slowloris connections meet it within the run)",
    )
    parser.add_argument("--body-timeout", type=float, default=60, help="the proxy's --body-timeout (idem)")
    parser.add_argument(
        "--settle",
        type=float,
        default=70,
        help="seconds after the load before the idle measurement (the proxy keeps "
        "idle upstream connections up to a minute)",
    )
    parser.add_argument("--no-kill", action="store_true", help="leave the writer alone")
    parser.add_argument("--rss-slack-mb", type=float, default=100, help="RSS allowed above idle at the end")
    parser.add_argument("--fd-slack", type=int, default=16, help="open fds allowed above idle at the end")
    args = parser.parse_args()
    if args.agents < 6:
        parser.error("--agents must be at least 6 (one per role, and streaming agents)")

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds the slowloris connections
    tmp = Path(tempfile.mkdtemp(prefix="lcap-soak-"))
    db = tmp / "soak.duckdb"
    env = {**os.environ, "LCAP_HOME": str(tmp / "home")}  # its own spool and CA: what a killed writer leaves stays here
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)
    up_port = int(upstream.stdout.readline())
    up_url = f"http://127.0.0.1:{up_port}"
    stderr_path = tmp / "proxy.stderr"
    with open(stderr_path, "w") as stderr:
        timeouts = ["--head-timeout", str(args.head_timeout), "--body-timeout", str(args.body_timeout)]
        proxy, port, bundle = start_proxy(
            [LCAP, "proxy", "--serve", "--upstream", up_url, "--db", str(db), *timeouts], env, stderr=stderr
        )
    helpers: list[subprocess.Popen] = [upstream]
    try:
        resource.prlimit(proxy.pid, resource.RLIMIT_NOFILE, (args.proxy_nofile, args.proxy_nofile))
        verify = ssl.create_default_context(cafile=bundle)
        urls = episode_proxy_urls(port, args.agents, env)
        roles = ["stream"] * (args.agents - 5) + ["whole", "whole", "hang", "reset", "oversize"]
        tallies = {role: Tally() for role in ROLES}
        print(
            f"soak: {args.agents} agents for {args.duration:.0f} s through lcap proxy --serve on :{port} (pid {proxy.pid})"
        )

        async def warm() -> None:
            await asyncio.gather(
                *(
                    agent(i, "warm", urls[i], verify, up_url, time.monotonic() + 0.01, Tally(), 0)
                    for i in range(args.agents)
                )
            )

        asyncio.run(warm())
        time.sleep(3)
        idle_before = proc_stats(proxy.pid)
        fds_before = fd_kinds(proxy.pid, port)
        writers_at_start = writer_pids(proxy.pid)
        print(
            f"  idle after warm-up: RSS {idle_before[0]:.0f} MB, {idle_before[1]} fds; writer pids {writers_at_start}"
        )

        slow = Slow()
        peak = list(idle_before)
        events: list[str] = []

        async def run() -> None:
            t0 = time.monotonic()
            at = lambda fraction: t0 + fraction * args.duration  # noqa: E731
            deadline = at(1.0)

            async def timeline() -> None:
                plan = []
                if not args.no_kill:
                    plan += [(0.40, "kill"), (0.75, "kill")]
                if args.lock_seconds:
                    plan.append((0.15, "lock"))
                for fraction, what in sorted(plan):
                    await asyncio.sleep(max(0.0, at(fraction) - time.monotonic()))
                    if what == "kill":
                        pids = writer_pids(proxy.pid)
                        for pid in pids:
                            os.kill(pid, signal.SIGKILL)
                        events.append(f"{time.monotonic() - t0:5.0f} s  kill -9 of the writer {pids or '(none found)'}")
                    else:
                        lock = subprocess.Popen(
                            [sys.executable, "-c", LOCK, str(db), str(args.lock_seconds)],
                            stdout=subprocess.PIPE,
                            text=True,
                        )
                        helpers.append(lock)
                        got = await asyncio.to_thread(lock.stdout.readline)
                        events.append(
                            f"{time.monotonic() - t0:5.0f} s  store {'held' if got else 'NOT held'} by pid "
                            f"{lock.pid} for {args.lock_seconds:.0f} s"
                        )
                await asyncio.sleep(max(0.0, deadline - time.monotonic()))

            async def sample() -> None:
                while time.monotonic() < deadline:
                    rss, fds = proc_stats(proxy.pid)
                    peak[0], peak[1] = max(peak[0], rss), max(peak[1], fds)
                    await asyncio.sleep(2)

            auth = base64.b64encode(b"soak-oversize:x").decode()
            jobs = [
                agent(i, role, urls[i], verify, up_url, deadline, tallies[role], args.think)
                for i, role in enumerate(roles)
                if role != "oversize"
            ]
            if args.oversize_mb:
                jobs.append(
                    oversize_agent(
                        port,
                        auth,
                        up_port,
                        args.oversize_mb,
                        args.oversize_every,
                        at(0.15),
                        deadline,
                        tallies["oversize"],
                    )
                )
            if args.slowloris:
                jobs.append(
                    slowloris(
                        port, up_port, args.slowloris, at(0.20), at(0.60), slow, (args.head_timeout, args.body_timeout)
                    )
                )
            await asyncio.gather(timeline(), sample(), *jobs)

        asyncio.run(run())
        time.sleep(args.settle)
        idle_after = proc_stats(proxy.pid)
        fds_added = fd_kinds(proxy.pid, port) - fds_before
        writers_at_end = writer_pids(proxy.pid)
        with httpx.Client(trust_env=False, timeout=30) as client:
            received = {role: set(calls) for role, calls in client.get(f"{up_url}/soak-stats").json().items()}
        proxy.send_signal(signal.SIGINT)
        try:
            code = proxy.wait(300)
        except subprocess.TimeoutExpired:
            proxy.kill()
            code = None
        for pid in writers_at_start + writers_at_end:  # the writer outlives the proxy to finish its batch
            deadline = time.monotonic() + 180
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.5)
        stored, dead_letters = _stored(db)
        spool_left = _spool_bytes(tmp)
        replayed = _replay(db, up_url, env, tmp) if spool_left else None
    finally:
        for helper in helpers:
            if helper.poll() is None:
                helper.kill()
        if proxy.poll() is None:
            proxy.kill()
    return _report(
        args,
        Soak(
            tallies=tallies,
            received=received,
            stored=stored,
            dead_letters=dead_letters,
            replayed=replayed,
            slow=slow,
            idle_before=idle_before,
            idle_after=idle_after,
            fds_added=fds_added,
            peak=(peak[0], int(peak[1])),
            events=events,
            writers=(writers_at_start, writers_at_end),
            errors=stderr_path.read_text(errors="replace"),
            code=code,
            spool_left=spool_left,
            tmp=tmp,
        ),
    )


def _spool_bytes(tmp: Path) -> int:
    """Bytes of turns left in the spool (the records a writer has not stored yet)."""
    files = [p for p in (tmp / "home" / "spool").glob("*/*") if p.is_file() and p.name[:1].isdigit()]  # segments
    return sum(p.stat().st_size for p in files)


def _replay(db: Path, up_url: str, env: dict[str, str], tmp: Path) -> dict[str, list[str]]:
    """Start a next proxy on the store, whose writer replays spools left by dead proxies (lcap's recovery), and
    return what is stored once the spool is empty (or after 5 minutes): lost for good, or only late?"""
    with open(tmp / "replay.stderr", "w") as stderr:
        proxy, _, _ = start_proxy([LCAP, "proxy", "--serve", "--upstream", up_url, "--db", str(db)], env, stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while _spool_bytes(tmp) and time.monotonic() < deadline:
            time.sleep(1)
        writers = writer_pids(proxy.pid)
        proxy.send_signal(signal.SIGINT)
        proxy.wait(300)
        for pid in writers:
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline + 180:
                time.sleep(0.5)
    finally:
        if proxy.poll() is None:
            proxy.kill()
    return _stored(db)[0]


def _stored(db: Path) -> tuple[dict[str, list[str]], int]:
    """The call names of the stored turns, by role (with repeats, if any), and the rows of any dead-letter table."""
    import duckdb

    deadline = time.monotonic() + 120
    while True:
        try:
            con = duckdb.connect(str(db), read_only=True)
            break
        except duckdb.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    try:
        rows = con.execute("SELECT regexp_extract(path, 'soak=([a-z]+-[0-9]+-[0-9]+)', 1) FROM turns").fetchall()
        dead = 0
        for (table,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall():
            if re.search(r"dead|letter|reject|quarantin|unstored|poison", table.lower()):
                dead += len(con.execute(f'SELECT 1 FROM "{table}"').fetchall())
    finally:
        con.close()
    stored: dict[str, list[str]] = defaultdict(list)
    for (call,) in rows:
        if call:
            stored[call.split("-", 1)[0]].append(call)
    return stored, dead


@dataclass
class Soak:
    """What a run saw, for the report."""

    tallies: dict[str, Tally]
    received: dict[str, set[str]]  # the calls the upstream got, by role
    stored: dict[str, list[str]]  # the calls stored, by role (a call twice if stored twice)
    dead_letters: int
    replayed: dict[str, list[str]] | None  # stored once a next proxy replayed the spool, if anything was left
    slow: Slow
    idle_before: tuple[float, int]  # the proxy's RSS (MB) and open fds
    idle_after: tuple[float, int]
    fds_added: Counter[str]  # open fds idle after and not before, by kind (`fd_kinds`)
    peak: tuple[float, int]
    events: list[str]
    writers: tuple[list[int], list[int]]  # writer pids at the start and at the end
    errors: str  # the proxy's stderr
    code: int | None
    spool_left: int
    tmp: Path


def _report(args: argparse.Namespace, soak: Soak) -> int:
    checks: list[tuple[str, bool]] = []
    print(
        f"\n{'role':<10}{'sent':>8}{'answered':>10}{'refused':>9}{'failed':>8}{'upstream got':>14}{'stored':>8}{'dup':>5}"
        f"{'lost':>6}{'extra':>7}" + (f"{'after a replay':>17}" if soak.replayed is not None else "")
    )
    for role in ROLES:
        tally, got, kept = soak.tallies[role], soak.received.get(role, set()), soak.stored.get(role, [])
        keep = set(kept)
        lost, extra = got - keep, keep - got - set(tally.refused_calls)
        print(
            f"{role:<10}{len(tally.sent):>8}{len(tally.answered):>10}{sum(tally.refused.values()):>9}"
            f"{sum(tally.failed.values()):>8}{len(got):>14}{len(keep):>8}{len(kept) - len(keep):>5}{len(lost):>6}"
            f"{len(extra):>7}"
            + (f"{len(set(soak.replayed.get(role, [])) & got):>17}" if soak.replayed is not None else "")
        )
        if tally.refused or tally.failed:
            print(f"{'':<10}refused {dict(tally.refused)}  failed {dict(tally.failed)}")
        checks.append((f"{role}: every call the upstream received is stored ({len(lost)} not)", not lost))
        checks.append((f"{role}: every answered call is stored", tally.answered <= keep))
        refused_for_size = {c for c, status in tally.refused_calls.items() if status in (408, 413)}
        checks.append((f"{role}: every call refused for its size or time is stored", refused_for_size <= keep))
        if role in ("stream", "whole"):
            checks.append(
                (f"{role}: no call failed (shed with 503 aside)", not tally.failed and set(tally.refused) <= {503})
            )
    if soak.dead_letters:
        print(f"(rows in dead-letter tables: {soak.dead_letters})")
    if soak.replayed is not None:
        print("(after a replay: the calls the upstream got that are stored once a next proxy on the store replayed the")
        print(" spool this one left, lcap's recovery; the checks are on what this proxy stored)")
    print("\nevents:")
    for line in soak.events:
        print(f"  {line}")
    print(f"  writer pids at start {soak.writers[0]}, at end {soak.writers[1]}")
    checks.append(("a writer is running at the end (supervised)", bool(soak.writers[1])))
    if args.slowloris:
        closes = soak.slow.seconds_to_close
        soon, later = sum(t < 1 for t in closes), sum(1 <= t < 60 for t in closes)
        print(
            f"  slowloris: {soak.slow.opened} opened ({soak.slow.connect_failed} could not connect); the proxy closed "
            f"{soak.slow.closed_by_proxy} ({soon} within 1 s, {later} within 1 to 60 s, {len(closes) - soon - later} "
            f"later), answering {dict(soak.slow.answered)}; still open at the end: {soak.slow.overdue} past the "
            f"proxy's timeout, {soak.slow.young} opened too late to meet it"
        )
        if 0.4 * args.duration > max(args.head_timeout, args.body_timeout) + 10:
            closed = soak.slow.overdue == 0 and soak.slow.young < soak.slow.opened / 2
            checks.append(("slowloris connections were closed or answered by the proxy in time", closed))
        else:
            print("  (not checked: the slowloris window, 40% of --duration, is not longer than the proxy's timeouts)")
    print(
        f"\nproxy: idle before RSS {soak.idle_before[0]:.0f} MB, {soak.idle_before[1]} fds; peak RSS {soak.peak[0]:.0f} MB, "
        f"{soak.peak[1]} fds; idle after RSS {soak.idle_after[0]:.0f} MB, {soak.idle_after[1]} fds"
    )
    if soak.fds_added:
        print("  fds idle after, not before: " + ", ".join(f"{n} {kind}" for kind, n in soak.fds_added.most_common()))
    checks.append(
        (f"open fds back to idle (+{args.fd_slack})", soak.idle_after[1] <= soak.idle_before[1] + args.fd_slack)
    )
    checks.append(
        (
            f"RSS back to idle (+{args.rss_slack_mb:.0f} MB)",
            soak.idle_after[0] <= soak.idle_before[0] + args.rss_slack_mb,
        )
    )
    print(f"  left in the spool after the proxy and its writer ended: {soak.spool_left} bytes")
    checks.append(("nothing left in the spool", soak.spool_left == 0))
    destroyed = soak.errors.count("Task was destroyed but it is pending")
    too_many = soak.errors.count("Too many open files")
    report = [line for line in soak.errors.splitlines() if "turns" in line or "spool" in line][-3:]
    print(f"  its stderr: {destroyed} 'Task was destroyed but it is pending!', {too_many} 'Too many open files'")
    for line in report:
        print(f"  its report: {line.strip()}")
    checks.append(("no task destroyed while pending", destroyed == 0))
    checks.append(("the proxy exited 0", soak.code == 0))
    print("\nchecks:")
    for what, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {what}")
    failed = [what for what, ok in checks if not ok]
    print(f"\n{len(checks) - len(failed)} of {len(checks)} checks passed; proxy stderr in {soak.tmp / 'proxy.stderr'}")
    print("(the capture-overhead targets are checked by benchmarks/bench_proxy.py)")
    if not failed:
        shutil.rmtree(soak.tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
