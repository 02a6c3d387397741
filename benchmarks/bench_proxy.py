"""Added latency of `lcap proxy` against a local upstream, side by side with its baselines in one run.

    .venv/bin/python benchmarks/bench_proxy.py [--n 300] [--rounds 500] [--no-litellm] [--paths a,b,...]

Starts a minimal asyncio HTTP upstream (OpenAI chat completions, plain and SSE; on uvloop) in a subprocess and
measures from this process with httpx, all paths interleaved round by round, in a random order
each round, so machine noise hits them alike:
- direct: straight to the upstream;
- direct again: the same as direct, from a second client: how far two identical paths differ in this run,
  the noise under every other row's figures;
- direct https: straight to the same upstream served over TLS (on uvloop, as vLLM's server runs, with a
  certificate from lcap's CA like the one lcap shows): the baseline of `lcap https`, since an agent calling
  the API over HTTPS pays its own TLS with or without lcap;
- lcap http / lcap https: `lcap proxy --serve --upstream` (every call stored); plain HTTP through
  the proxy, and HTTPS to api.openai.com rerouted (CONNECT + TLS interception with lcap's CA,
  keep-alive): what a real agent pays. Both take the front's short path (capture/proxy/front.py);
  the mitmproxy row is what every call paid before it;
- lcap transparent: `lcap proxy --transparent --upstream` (a second lcap, its own store) around an agent that
  only holds its namespace open; this process makes the connections of that row inside the agent's network
  namespace (a thread that entered it creates each socket), to an address lcap's rules redirect, with
  SNI api.openai.com: what an agent that ignores proxy settings pays (no CONNECT; SO_ORIGINAL_DST, then
  the same TLS interception). Needs root (or user namespaces) and iptables, else the row is left out;
- mitmproxy: stock mitmproxy embedded with the same three addons lcap loads and an addon that only
  reroutes and streams answers through (no capture): the floor under lcap's own work;
- mitmdump: stock `mitmdump` (all default addons) with the same reroute script, as a user would run it;
- litellm: LiteLLM's proxy (benchmarks/litellm_gateway.py; its own venv), when installed;
- relay: a bare asyncio TCP relay to the upstream (no HTTP parsing, no TLS, nothing stored): one
  more hop through a Python event loop, the floor under any proxy written in Python on this machine.
Cases: c=1 and c=16 (16 requests in flight), non-streaming (full response) and streaming (time to
the first SSE chunk). Added latency is against each path's baseline ("vs"): direct https for lcap https,
direct for the rest; a last line gives lcap https against plain direct too. At the end lcap is stopped
and every call it proxied must be a turn in the store.
"client CPU" is this process's CPU time per call on each path (at c=1, for the whole call): what the
client itself spends, e.g. on TLS, which an agent pays calling the real API too.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpcore
import httpx

REPO = Path(__file__).resolve().parents[1]
LCAP = str(REPO / ".venv" / "bin" / "lcap") if (REPO / ".venv" / "bin" / "lcap").exists() else shutil.which("lcap")

UPSTREAM = r"""
import asyncio, json, os, sys
DELAY = float(os.environ.get("BENCH_UPSTREAM_DELAY", "0"))  # seconds before each answer, as a model's would take
BODY = json.dumps({"id": "c1", "object": "chat.completion", "model": "m", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
CHUNK = b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}\n\n'
LAST = b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'

async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = 0
            for line in lines[1:]:
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            body = await reader.readexactly(length) if length else b""
            if DELAY and not lines[0].startswith("GET"):
                await asyncio.sleep(DELAY)
            if lines[0].startswith("GET"):
                data = b'{"object":"list","data":[{"id":"m","owned_by":"bench"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
            elif b'"stream": true' in body or b'"stream":true' in body:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                await writer.drain()
                await asyncio.sleep(0.005)
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(LAST), LAST))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()

async def main():
    tls = None
    if len(sys.argv) > 2:  # CERT KEY: serve HTTPS
        import ssl
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.set_alpn_protocols(["http/1.1"])
        tls.load_cert_chain(sys.argv[1], sys.argv[2])
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256, ssl=tls)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()

try:  # the loop vLLM's server runs on, whose TLS is compiled: the direct https baseline is not a slow server's
    from uvloop import run
except ImportError:
    run = asyncio.run
run(main())
"""

REROUTE = r"""
import os
UP = int(os.environ["BENCH_UPSTREAM_PORT"])

class Reroute:
    def request(self, flow):
        flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", UP
        flow.request.headers.pop("proxy-authorization", None)

    def responseheaders(self, flow):
        flow.response.stream = True  # else mitmproxy holds SSE until the stream ends

addons = [Reroute()]
"""

RELAY = r"""
import asyncio, sys

async def pump(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
    finally:
        writer.close()

async def handle(client_reader, client_writer):
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", int(sys.argv[1]))
    await asyncio.gather(pump(client_reader, up_writer), pump(up_reader, client_writer), return_exceptions=True)

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()

asyncio.run(main())
"""

BARE = r"""
import asyncio, os, sys
from mitmproxy import options
from mitmproxy.addons import next_layer, proxyserver, tlsconfig
from mitmproxy.master import Master
from mitmproxy.utils import asyncio_utils
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from reroute import Reroute
if os.environ.get("BENCH_SKIP_DEBUG_CHECKS"):  # benchmarks/count_proxy_instructions.py's middle row
    from lcap.capture.proxy.mitm_guards import skip_debug_checks
    skip_debug_checks()

async def main():
    opts = options.Options()
    master = Master(opts)
    master.addons.add(proxyserver.Proxyserver(), next_layer.NextLayer(), tlsconfig.TlsConfig(), Reroute())
    opts.update(confdir=sys.argv[2], listen_host="127.0.0.1", listen_port=0, mode=["regular"],
                connection_strategy="lazy", upstream_cert=False)
    server = master.addons.get("proxyserver")
    with asyncio_utils.set_eager_task_factory():
        await server.setup_servers()
        print(server.listen_addrs()[0][1], flush=True)
        await master.running()
        await master.should_exit.wait()

asyncio.run(main())
"""

BASELINE = {
    "lcap https": "direct https",
    "lcap transparent": "direct https",
}  # what an agent calling the API over HTTPS pays without lcap; others: direct

REQUEST = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say ok."}]}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def _one(client: httpx.AsyncClient, url: str, stream: bool) -> float:
    body = {**REQUEST, "stream": True} if stream else REQUEST
    t0 = time.perf_counter()
    if not stream:
        resp = await client.post(url, json=body)
        resp.read()
        assert resp.status_code == 200, resp.text
        return (time.perf_counter() - t0) * 1000
    async with client.stream("POST", url, json=body) as resp:
        chunks = resp.aiter_raw()
        await chunks.__anext__()
        first = (time.perf_counter() - t0) * 1000
        async for _chunk in chunks:
            pass
    return first


async def _measure(
    clients: dict[str, tuple[httpx.AsyncClient, str]],
    *,
    concurrency: int,
    rounds: int,
    stream: bool,
    every: dict[str, int] | None = None,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Alternate the paths round by round, back to back, in a new random order each round (a fixed order
    biases a path by the one before it); each round sends `concurrency` requests at once on one path, except
    that a path named in `every` takes part in one round in that many (a slow reference row).
    Returns the latencies, and the client's own CPU time per call on each path (us)."""
    every = every or {}
    results: dict[str, list[float]] = {name: [] for name in clients}
    cpu = dict.fromkeys(clients, 0.0)
    for client, url in clients.values():  # warm connections (and TLS sessions)
        await asyncio.gather(*(_one(client, url, stream) for _ in range(concurrency)))
    shuffle = random.Random(0).shuffle
    for n in range(rounds):
        order = [name for name in clients if n % every.get(name, 1) == 0]
        shuffle(order)
        for name in order:
            client, url = clients[name]
            t0 = time.process_time()
            results[name] += await asyncio.gather(*(_one(client, url, stream) for _ in range(concurrency)))
            cpu[name] += time.process_time() - t0
    return results, {name: t / len(results[name]) * 1e6 for name, t in cpu.items()}


class Sink:
    """Where `capture_call` hands finished turns: any `put`."""

    def __init__(self, put: Callable[[Any], None]) -> None:
        self.put = put


def capture_call(sink: Any) -> Callable[[], None]:
    """One rerouted 8 KB chat call through lcap's `Calls` per invocation, as either listener carries it: opened,
    its body and answer taken, and its finished turn handed to `sink.put` (the proxy's `TurnWriter` takes it
    there)."""
    from lcap.capture.proxy.calls import Calls
    from lcap.capture.routing.routes import Router

    calls = Calls(sink, Router("http://127.0.0.1:9", None), token_ids=False, require_credentials=True)
    body = json.dumps({**REQUEST, "messages": [{"role": "user", "content": "x" * 2000}] * 4}).encode()
    answer = json.dumps(
        {
            "id": "c",
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok" * 100}, "finish_reason": "stop"}],
        }
    ).encode()
    fields = (
        (b"Host", b"api.openai.com"),
        (b"Authorization", b"Bearer " + os.urandom(16).hex().encode()),  # a key, made up at run time
        (b"Content-Type", b"application/json"),
        (b"Proxy-Authorization", b"Basic " + base64.b64encode(calls.keys.pair("bench").encode())),
    )

    def one() -> None:
        episode, role, rest = calls.attribute(fields)
        call = calls.open_call(
            "chat",
            episode,
            role,
            scheme="https",
            host="api.openai.com",
            port=443,
            path="/v1/chat/completions",
            fields=rest,
        )
        calls.take_body(call, body)
        calls.answer_head(call.pending, 200, "application/json", None)
        calls.answer_body(call.pending, answer)

    return one


def capture_cost(n: int = 2000) -> tuple[float, float, float]:
    """lcap's own share of a call (`capture_call`, spooling the turn: p50, p99 in us), and the writer process's
    row building per turn (us)."""
    from lcap.capture.storage.spool import SpoolAppender, SpoolReader, unseal
    from lcap.capture.turns.turn import build_row

    spool_root = Path(tempfile.mkdtemp(prefix="lcap-bench-spool-"))
    spool_dir = spool_root / "bench"
    spool = SpoolAppender(spool_dir, spool_root / "unused.duckdb")
    call = capture_call(Sink(spool.append))

    def one() -> float:
        t0 = time.perf_counter()
        call()
        return (time.perf_counter() - t0) * 1e6

    for _ in range(200):
        one()
    times = [one() for _ in range(n)]
    spool.close()
    records = [unseal(spool.cipher, entry.payload) for entry in SpoolReader(spool_dir).read()[-n:]]
    t0 = time.perf_counter()
    for pending in records:
        build_row(pending)
    per_row = (time.perf_counter() - t0) / n * 1e6
    shutil.rmtree(spool_root, ignore_errors=True)
    return _pct(times, 0.5), _pct(times, 0.99), per_row


def _leaf_files(ca_dir: Path, tmp: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 from lcap's CA, made as lcap makes the ones it shows agents, and its key."""
    from lcap.capture.trust.ca import CA_BASENAME
    from lcap.capture.trust.certs import LeafCerts

    chain, key = LeafCerts(ca_dir, CA_BASENAME).pem("127.0.0.1")
    cert_file, key_file = tmp / "upstream-cert.pem", tmp / "upstream-key.pem"
    cert_file.write_bytes(chain)
    key_file.write_bytes(key)
    return str(cert_file), str(key_file)


def start_proxy(
    argv: list[str], env: dict[str, str], cwd: Path | None = None, stderr: IO[str] | None = None
) -> tuple[subprocess.Popen, int, str]:
    """Start `lcap proxy --serve ...`; its process, port and the CA bundle it exports. Its stderr is this one's
    unless given."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"proxy did not start: {argv}")
    port = int(line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)[1])
    bundle = proc.stdout.readline().split("SSL_CERT_FILE=", 1)[1].strip()
    return proc, port, bundle


def episode_proxy(port: int, name: str = "bench", env: dict[str, str] | None = None) -> str:
    """The proxy URL of episode `name` on the proxy listening on `port`, minted by `lcap episode new` as an agent's
    would be; a revision of lcap without episode secrets (ab_proxy's base, say) takes any password."""
    minted = subprocess.run(
        [LCAP, "episode", "new", "--port", str(port), "--id", name], env=env, capture_output=True, text=True
    )
    return minted.stdout.strip() if minted.returncode == 0 else f"http://{name}:x@127.0.0.1:{port}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on {port} within {timeout:.0f} s")


class NamespaceBackend:
    """httpcore's network backend for the `lcap transparent` row: each connection's socket is made by a thread
    that entered the agent's network namespace (`setns`), so lcap's rules there redirect it; it connects to a
    documentation address (203.0.113.1) on the port asked for, as if the agent's own DNS answer had been that,
    and the host name travels in the TLS SNI."""

    ADDRESS = "203.0.113.1"

    def __init__(self, netns: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1, initializer=self._enter, initargs=(netns,))

    @staticmethod
    def _enter(netns: str) -> None:
        import ctypes

        fd = os.open(netns, os.O_RDONLY)
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET, this thread only
            raise OSError(ctypes.get_errno(), "setns")
        os.close(fd)

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        import anyio.abc
        from httpcore._backends.anyio import AnyIOStream

        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(self.pool, socket.socket)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, (self.ADDRESS, port))
        return AnyIOStream(await anyio.abc.SocketStream.from_socket(sock))

    async def connect_unix_socket(self, *args, **kwargs):
        raise NotImplementedError

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


HOLDER = "import os, sys; print('holder', os.getpid(), flush=True); sys.stdin.read()"


def start_transparent(up_url: str, db: Path, env: dict[str, str]) -> tuple[subprocess.Popen | None, str]:
    """`lcap proxy --transparent` around an agent that holds its namespace until its stdin closes; the process and
    the agent's network namespace, or None and why not."""
    proc = subprocess.Popen(
        [LCAP, "proxy", "--transparent", "--upstream", up_url, "--db", str(db), "--", sys.executable, "-c", HOLDER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().split()
    if line[:1] != ["holder"]:
        proc.kill()
        return None, (proc.communicate()[1].strip().splitlines() or ["lcap exited"])[-1]
    return proc, f"/proc/{line[1]}/ns/net"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="requests per path at concurrency 1")
    parser.add_argument(
        "--rounds",
        type=int,
        default=500,
        help="rounds of 16 concurrent requests per path (LiteLLM: "
        "one in 5); a p99 at c=16 needs thousands of samples here, since the machine's noise comes in bursts "
        "that slow whole rounds",
    )
    parser.add_argument("--no-litellm", action="store_true", help="leave out the LiteLLM row")
    parser.add_argument("--paths", default="", help="run only these paths (comma-separated names, as printed)")
    args = parser.parse_args()
    only = {p.strip() for p in args.paths.split(",") if p.strip()}

    tmp = Path(tempfile.mkdtemp(prefix="lcap-bench-"))
    home = os.environ.get("LCAP_HOME", str(Path.home() / ".lcap"))
    env = {**os.environ, "LCAP_HOME": home}
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, **kwargs)
        procs.append(proc)
        return proc

    upstream = spawn([sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)
    up_port = int(upstream.stdout.readline())
    up_url = f"http://127.0.0.1:{up_port}"
    db = tmp / "bench.duckdb"
    litellm = None
    try:
        proxy, lcap_port, bundle = start_proxy([LCAP, "proxy", "--serve", "--upstream", up_url, "--db", str(db)], env)
        procs.append(proxy)

        secure = spawn(
            [sys.executable, "-c", UPSTREAM, *_leaf_files(Path(home) / "ca", tmp)], stdout=subprocess.PIPE, text=True
        )
        secure_port = int(secure.stdout.readline())

        (tmp / "reroute.py").write_text(REROUTE)
        base_env = {**env, "BENCH_UPSTREAM_PORT": str(up_port)}
        bare = spawn(
            [sys.executable, "-c", BARE, str(tmp / "reroute.py"), str(Path(home) / "ca")],
            env=base_env,
            stdout=subprocess.PIPE,
            text=True,
        )
        bare_port = int(bare.stdout.readline())
        dump_port = _free_port()
        mitmdump = str(Path(sys.executable).with_name("mitmdump"))
        spawn(
            [
                mitmdump,
                "-q",
                "--listen-host",
                "127.0.0.1",
                "--listen-port",
                str(dump_port),
                "-s",
                str(tmp / "reroute.py"),
                "--set",
                f"confdir={Path(home) / 'ca'}",
                "--set",
                "connection_strategy=lazy",
            ],
            env=base_env,
        )
        _wait_listening(dump_port, procs[-1], "mitmdump")

        transparent, netns = (None, "not asked for") if only and "lcap transparent" not in only else (None, "")
        if not netns:
            transparent, netns = start_transparent(up_url, tmp / "transparent.duckdb", env)
            if transparent is None:
                print(f"(no lcap transparent row: {netns})")
            else:
                procs.append(transparent)

        relay = spawn([sys.executable, "-c", RELAY, str(up_port)], stdout=subprocess.PIPE, text=True)
        relay_port = int(relay.stdout.readline())
        litellm_url = None
        if not args.no_litellm:
            import litellm_gateway

            if litellm_gateway.available():
                litellm, litellm_url = litellm_gateway.start_litellm(up_url, tmp)
            else:
                print(f"(no LiteLLM row: no venv at {litellm_gateway.LITELLM_VENV}; see benchmarks/litellm_gateway.py)")

        async def run() -> list[tuple]:
            limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
            ctx = ssl.create_default_context(cafile=bundle)

            def client(**kwargs) -> httpx.AsyncClient:
                return httpx.AsyncClient(limits=limits, trust_env=False, timeout=60, **kwargs)

            chat = f"{up_url}/v1/chat/completions"
            lcap_proxy = episode_proxy(lcap_port)
            clients = {
                "direct": (client(), chat),
                "direct again": (client(), chat),
                "direct https": (client(verify=ctx), f"https://127.0.0.1:{secure_port}/v1/chat/completions"),
                "lcap http": (client(proxy=lcap_proxy), chat),
                "lcap https": (client(proxy=lcap_proxy, verify=ctx), "https://api.openai.com/v1/chat/completions"),
                "mitmproxy": (client(proxy=f"http://127.0.0.1:{bare_port}"), chat),
                "mitmdump": (client(proxy=f"http://127.0.0.1:{dump_port}"), chat),
            }
            if transparent is not None:
                inside = httpx.AsyncHTTPTransport(verify=ctx, limits=limits)
                inside._pool = httpcore.AsyncConnectionPool(  # the same pool, its sockets made in the namespace
                    ssl_context=ctx, max_connections=32, network_backend=NamespaceBackend(netns)
                )
                clients["lcap transparent"] = (client(transport=inside), "https://api.openai.com/v1/chat/completions")
            if litellm_url:
                clients["litellm"] = (client(headers=litellm_gateway.HEADERS), litellm_url)
            clients["relay"] = (client(), f"http://127.0.0.1:{relay_port}/v1/chat/completions")
            if only:
                for name in [n for n in clients if n not in only and n not in ("direct", "direct https")]:
                    await clients.pop(name)[0].aclose()
            rows = []
            try:
                for label, conc, rounds, stream in (
                    ("non-streaming c=1", 1, args.n, False),
                    ("non-streaming c=16", 16, args.rounds, False),
                    ("streaming TTFC c=1", 1, args.n, True),
                    ("streaming TTFC c=16", 16, args.rounds, True),
                ):
                    rows.append(
                        (
                            label,
                            *await _measure(
                                clients,
                                concurrency=conc,
                                rounds=rounds,
                                stream=stream,
                                every={"litellm": 5} if conc > 1 else None,
                            ),
                        )
                    )
            finally:
                for c, _ in clients.values():
                    await c.aclose()
            return rows

        rows = asyncio.run(run())
        proxy.send_signal(signal.SIGINT)
        proxy.wait(120)
        if transparent is not None:
            transparent.communicate("", timeout=120)  # the agent's stdin closes: it ends, and lcap with it
    finally:
        if litellm is not None:
            litellm_gateway.stop_litellm(litellm)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    lcap_sent = 0
    print(
        f"{'case':<22}{'path':<18}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'vs':>14}{'+p50 ms':>9}{'+p99 ms':>9}{'p50 x':>7}"
        f"{'client CPU us':>15}"
    )
    for label, res, cpu in rows:
        for name, values in res.items():
            p50, p99 = _pct(values, 0.5), _pct(values, 0.99)
            extra = f"{'':>39}"
            if name not in ("direct", "direct https"):
                base = BASELINE.get(name, "direct")
                b50, b99 = _pct(res[base], 0.5), _pct(res[base], 0.99)
                extra = f"{base:>14}{p50 - b50:>9.2f}{p99 - b99:>9.2f}{p50 / b50:>7.2f}"
            print(f"{label:<22}{name:<18}{len(values):>6}{p50:>9.2f}{p99:>9.2f}{extra}{cpu[name]:>15.0f}")
            if name.startswith("lcap"):
                lcap_sent += len(values)
    if "lcap https" in rows[0][1]:
        print(
            "lcap https vs plain direct, +p50 / +p99 ms: "
            + "; ".join(
                f"{label} {_pct(res['lcap https'], 0.5) - _pct(res['direct'], 0.5):+.2f} / "
                f"{_pct(res['lcap https'], 0.99) - _pct(res['direct'], 0.99):+.2f}"
                for label, res, _ in rows
            )
        )
    if "lcap transparent" in rows[0][1] and "lcap https" in rows[0][1]:
        print(
            "lcap transparent vs lcap https, +p50 / +p99 ms: "
            + "; ".join(
                f"{label} {_pct(res['lcap transparent'], 0.5) - _pct(res['lcap https'], 0.5):+.2f} / "
                f"{_pct(res['lcap transparent'], 0.99) - _pct(res['lcap https'], 0.99):+.2f}"
                for label, res, _ in rows
            )
        )
    import duckdb

    stored = 0
    for store in (db, tmp / "transparent.duckdb"):
        if store.exists():
            con = duckdb.connect(str(store), read_only=True)
            stored += con.execute("SELECT count(*) FROM turns").fetchone()[0]
            con.close()
    lcap_paths = sum(name.startswith("lcap") for name in rows[0][1])
    warm = sum(16 if "c=16" in label else 1 for label, _, _ in rows) * lcap_paths
    print(f"turns stored by lcap: {stored} of {lcap_sent + warm} calls it proxied (including warm-up)")
    p50, p99, per_row = capture_cost()
    print(
        f"lcap's capture work per call (8 KB request, rerouted, spool record included): p50 {p50:.0f} us, p99 {p99:.0f} us; "
        f"the writer process builds a row in {per_row:.0f} us"
    )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
