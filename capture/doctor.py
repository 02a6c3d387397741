"""`lcap doctor`'s checks of capture: lcap's CA (there, private, in the bundle children get, trusted by each client
through that bundle), the Node preload, the spool (its key, what waits in it), what `--transparent` and `--sandbox`
need, and a live round trip through a throwaway proxy.

The trust checks run each client against a local TLS server whose certificate lcap's CA signed, with the
environment lcap gives its children (`trust_env`): a client that does not trust it there would not trust the
proxy either.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.capture.reach.agent_env import PROXY_VARS, trust_env
from lcap.capture.reach.jvm import TRUST_STORE
from lcap.capture.reach.node_preload import PACKAGES, PRELOAD, installed_version, node_dir, node_options, preload_env
from lcap.capture.sandbox import NAMESPACES, PACKAGE
from lcap.capture.sandbox import missing as sandbox_missing
from lcap.capture.storage.spool import KEY_NAME, SPOOL_MIN_FREE_BYTES, SPOOL_MIN_FREE_FRACTION, backlogs, spool_disk
from lcap.capture.trust.ca import CA_BASENAME, ca_bundle, ca_dir, ca_files, ensure_ca
from lcap.capture.trust.certs import LeafCerts
from lcap.config import LcapError, lcap_home
from lcap.doctor import Context, Result, check
from lcap.policy import bearer
from lcap.processes import alive, python_helper
from lcap.store import Store

CLIENT_TIMEOUT = 30.0  # seconds a client gets to fetch one page from the local TLS server
BACKLOG_RECORDS = 10_000  # a live proxy's writer this many turns behind is stuck, not busy
BACKLOG_SECONDS = 120.0  # ... or whose oldest waiting turn is this old


# --- lcap's CA -----------------------------------------------------------------------------------


@check("ca", section="capture", required=True)
def ca(ctx: Context) -> Result:
    """The CA exists (made now when missing, as any lcap proxy would), is a CA and is not expired."""
    cert, key = ca_files()
    made = not (cert.exists() and key.exists())
    if made:
        try:
            ensure_ca()
        except LcapError as exc:
            return Result.fail(
                str(exc), f"lcap needs to write its CA in {ca_dir()}: check that directory's owner and mode"
            )
    try:
        loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    except (OSError, ValueError) as exc:
        return Result.fail(
            f"cannot read lcap's CA certificate {cert}: {exc}",
            f"move {ca_dir()} away: lcap makes a new CA at its next start",
        )
    try:
        is_ca = loaded.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    until = loaded.not_valid_after_utc
    if not is_ca:
        return Result.fail(f"{cert} is not a CA certificate", f"move {ca_dir()} away: lcap makes a new CA")
    if until <= datetime.now(UTC):
        return Result.fail(
            f"lcap's CA expired on {until:%Y-%m-%d}",
            f"move {ca_dir()} away: lcap makes a new CA at its next start (trust the new one wherever you added it by hand)",
        )
    what = "made now" if made else f"valid until {until:%Y-%m-%d}"
    return Result.ok(f"{cert} ({what})", cert=str(cert), expires=until.isoformat(), made=made)


@check("ca.key", section="capture", required=True, needs=("ca",))
def ca_key(ctx: Context) -> Result:
    """The CA's private key (and its PKCS#12 copy) readable by its owner only; its directory writable by nobody else."""
    _cert, key = ca_files()
    problems, fixes = [], []
    for path in (key, ca_dir() / f"{CA_BASENAME}-ca.p12"):
        if not path.exists():
            continue
        st = path.stat()
        if st.st_mode & 0o077:
            problems.append(f"{path} is mode {st.st_mode & 0o777:04o} (others can read lcap's CA key)")
            fixes.append(f"chmod 600 {path}")
        if st.st_uid != os.getuid():
            problems.append(f"{path} belongs to uid {st.st_uid}, not you")
            fixes.append(f"chown {os.getuid()} {path}")
    directory = ca_dir().stat()
    if directory.st_mode & 0o022:
        problems.append(
            f"{ca_dir()} is writable by others (mode {directory.st_mode & 0o777:04o}): they could swap the CA"
        )
        fixes.append(f"chmod go-w {ca_dir()}")
    if problems:
        return Result.fail("; ".join(problems), "; ".join(fixes))
    return Result.ok(f"{key} is 0600")


@check("ca.bundle", section="capture", required=True, needs=("ca",))
def ca_bundle_check(ctx: Context) -> Result:
    """The bundle children get (system roots + lcap's CA) holds readable certificates, lcap's CA among them."""
    cert, _ = ca_files()
    try:
        bundle = ca_bundle(cert)  # what the next proxy gives its children (written again if stale)
    except OSError as exc:
        return Result.fail(f"cannot write the CA bundle in {ca_dir()}: {exc}", f"check the mode of {ca_dir()}")
    ctx.shared["bundle"] = bundle
    fix = f"rm {bundle}: lcap writes it again from the system roots and its CA (at the next start, or `lcap doctor ca`)"
    data = bundle.read_bytes()
    blocks = [b for b in data.split(b"-----END CERTIFICATE-----") if b"-----BEGIN CERTIFICATE-----" in b]
    ours = x509.load_pem_x509_certificate(cert.read_bytes())
    found, unreadable, has_ours = 0, 0, False
    for block in blocks:
        try:
            parsed = x509.load_pem_x509_certificate(block.strip() + b"\n-----END CERTIFICATE-----\n")
        except ValueError:
            unreadable += 1
            continue
        found += 1
        has_ours = has_ours or parsed == ours
    if not found:
        return Result.fail(f"{bundle} holds no readable certificate", fix)
    if not has_ours:
        return Result.fail(f"{bundle} lacks lcap's CA ({found} other certificates)", fix)
    if unreadable:
        return Result.fail(f"{bundle}: {unreadable} of {found + unreadable} certificates are damaged", fix)
    if found == 1:
        return Result.warn(
            f"{bundle} holds lcap's CA but no system roots: children reach real HTTPS hosts only through the proxy",
            "install the system's CA certificates (Debian: apt-get install ca-certificates)",
        )
    return Result.ok(f"{bundle}: lcap's CA and {found - 1} system roots", bundle=str(bundle), roots=found - 1)


# --- trust, client by client ------------------------------------------------------------------


class _QuietHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass


class _Page(_QuietHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that does not trust the certificate hangs up mid-handshake: that is what is being checked."""


@contextmanager
def _tls_server() -> Iterator[str]:
    """A local HTTPS server on 127.0.0.1 whose certificate lcap's CA signed; yields its URL."""
    context = LeafCerts(ca_dir(), CA_BASENAME, 4).context("127.0.0.1")
    server = _QuietServer(("127.0.0.1", 0), _Page)
    server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    with _serving(server, "lcap-doctor-tls") as port:
        yield f"https://127.0.0.1:{port}/lcap-doctor"


@contextmanager
def _serving(server: _QuietServer, name: str) -> Iterator[int]:
    """Serve `server` on a daemon thread while the block runs; yields its port."""
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _client_env(ctx: Context) -> dict[str, str]:
    """The environment a child of lcap gets for trust, without the proxy (the clients fetch the page directly)."""
    cert, _ = ca_files()
    bundle = ctx.shared.get("bundle") or ca_bundle(cert)
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env.update(trust_env(bundle))
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def _run_client(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[int, str, str]:
    try:
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    except subprocess.TimeoutExpired:
        return 124, "", f"no answer within {CLIENT_TIMEOUT:g} s"
    except OSError as exc:
        return 127, "", str(exc)
    return done.returncode, done.stdout, done.stderr


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


_PYTHON_CLIENTS = r"""
import json, sys
url, out = sys.argv[1], {}
try:
    import urllib.request
    urllib.request.urlopen(url, timeout=20).read()
    out["urllib"] = "ok"
except Exception as exc:
    out["urllib"] = f"{type(exc).__name__}: {exc}"
for name in ("requests", "httpx"):
    try:
        module = __import__(name)
    except ImportError:
        continue
    try:
        module.get(url, timeout=20).raise_for_status()
        out[name] = "ok"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@check("trust.python", section="capture", required=True, needs=("ca",))
def trust_python(ctx: Context) -> Result:
    """Python's urllib (and requests, httpx where installed) trust lcap's CA through SSL_CERT_FILE / REQUESTS_CA_BUNDLE."""
    url = ctx.once("tls", _tls_server)
    _code, out, err = _run_client(python_helper(sys.executable, "-c", _PYTHON_CLIENTS, url), _client_env(ctx))
    try:
        clients = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Result.fail(f"the Python client did not run: {_last_line(err)}", f"run {sys.executable} -c 'import ssl'")
    bad = {name: why for name, why in clients.items() if why != "ok"}
    if bad:
        return Result.fail(
            "; ".join(f"{name}: {why}" for name, why in bad.items()),
            "lcap gives children SSL_CERT_FILE and REQUESTS_CA_BUNDLE = its bundle: check `lcap doctor ca.bundle`",
            clients=clients,
        )
    return Result.ok(f"{', '.join(clients)} trust lcap's CA", clients=clients)


@check("trust.curl", section="capture", required=True, needs=("ca",))
def trust_curl(ctx: Context) -> Result:
    curl = shutil.which("curl")
    if curl is None:
        return Result.skip("no curl on PATH")
    url = ctx.once("tls", _tls_server)
    argv = [curl, "--silent", "--show-error", "--max-time", "20", "--output", os.devnull, url]
    code, _, err = _run_client(argv, _client_env(ctx))
    if code:
        return Result.fail(
            f"curl: {_last_line(err)}",
            "lcap gives children CURL_CA_BUNDLE = its bundle: check `lcap doctor ca.bundle`, and that this curl reads "
            "CURL_CA_BUNDLE (a curl built without it needs --cacert $(lcap ca))",
        )
    return Result.ok("curl trusts lcap's CA (CURL_CA_BUNDLE)")


_NODE_CLIENTS = r"""
const url = process.argv[1], out = {};
const https = require('https');
fetch(url).then((r) => { out.fetch = r.ok ? 'ok' : `HTTP ${r.status}`; }, (e) => { out.fetch = String((e && e.cause) || e); })
  .then(() => new Promise((done) => {
    https.get(url, (r) => { out.https = 'ok'; r.resume(); r.on('end', done); })
      .on('error', (e) => { out.https = String(e); done(); });
  }))
  .then(() => console.log(JSON.stringify(out)));
"""


@check("trust.node", section="capture", required=True, needs=("ca",))
def trust_node(ctx: Context) -> Result:
    node = shutil.which("node")
    if node is None:
        return Result.skip("no node on PATH (Node agents are not used here)")
    url = ctx.once("tls", _tls_server)
    _code, out, err = _run_client([node, "-e", _NODE_CLIENTS, url], _client_env(ctx))
    try:
        clients = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Result.fail(f"node did not run: {_last_line(err)}", "check that `node -e 1` runs")
    bad = {name: why for name, why in clients.items() if why != "ok"}
    if bad:
        return Result.fail(
            "; ".join(f"node {name}: {why}" for name, why in bad.items()),
            "lcap gives children NODE_EXTRA_CA_CERTS = its bundle: check `lcap doctor ca.bundle`; "
            "a NODE_OPTIONS=--use-openssl-ca elsewhere changes which store Node reads",
            clients=clients,
        )
    return Result.ok("node fetch and https trust lcap's CA (NODE_EXTRA_CA_CERTS)", clients=clients)


_JAVA_CLIENT = """
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;

public class LcapTrust {
    public static void main(String[] args) throws Exception {
        HttpResponse<Void> r = HttpClient.newHttpClient()
            .send(HttpRequest.newBuilder(URI.create(args[0])).build(), HttpResponse.BodyHandlers.discarding());
        System.out.println(r.statusCode());
    }
}
"""


@check("trust.java", section="capture", required=False, needs=("ca",), timeout=CLIENT_TIMEOUT + 30)
def trust_java(ctx: Context) -> Result:
    """Java's HttpClient, with whatever lcap gives a JVM child (JAVA_TOOL_OPTIONS, where lcap sets one)."""
    java = shutil.which("java")
    if java is None:
        return Result.skip("no java on PATH (JVM agents are not used here)")
    url = ctx.once("tls", _tls_server)
    source = ctx.scratch / "LcapTrust.java"
    source.write_text(_JAVA_CLIENT)
    env = _client_env(ctx)
    code, out, err = _run_client([java, str(source), url], env, cwd=ctx.scratch)
    if code == 0 and out.strip().endswith("200"):
        return Result.ok("Java HttpClient trusts lcap's CA (JAVA_TOOL_OPTIONS)")
    store = ca_dir() / TRUST_STORE
    unset = "trustStore" not in env.get("JAVA_TOOL_OPTIONS", "")
    return Result.fail(
        f"Java: {_exception_line(err or out)}" + (" (lcap gives the JVM no trust store)" if unset else ""),
        f"lcap gives a JVM child its trust store {store} (system roots and lcap's CA, PKCS#12 without a password, "
        "read by JDK 11.0.12 and later): remove it and lcap writes it again; an older JDK needs a newer one",
    )


def _exception_line(text: str) -> str:
    """The JVM's exception (`javax.net.ssl.SSLHandshakeException: ...`), not the stack under it."""
    for raw in text.splitlines():
        if "Exception" in raw or "Error" in raw:
            return raw.split('Exception in thread "main" ', 1)[-1].strip()[:300]
    return _last_line(text)


# --- the Node preload ---------------------------------------------------------------------------


_PRELOAD_PROBE = (
    "const d = globalThis[Symbol.for('undici.globalDispatcher.1')];"
    "process.stdout.write(d ? d.constructor.name : 'none');"
)


@check("node.preload", section="capture", required=True)
def node_preload(ctx: Context) -> Result:
    """The preload's npm packages are installed at their pinned versions, and the preload routes Node's fetch."""
    node = shutil.which("node")
    if node is None:
        return Result.skip("no node on PATH (Node agents are not used here)")
    wrong = {name: installed_version(name) for name, version in PACKAGES.items() if installed_version(name) != version}
    if wrong and not any(wrong.values()):  # never installed: a user of Python (or other) agents needs none of it
        return Result.warn(
            f"the Node preload is not installed ({node_dir()}): Node agents would call their hosts directly, "
            "uncaptured; agents in other languages need nothing from it",
            "lcap setup node, to run Node agents (needs npm and the npm registry, once)",
        )
    if wrong:
        listing = ", ".join(f"{name} {have or 'missing'} (wants {PACKAGES[name]})" for name, have in wrong.items())
        return Result.fail(
            f"{listing} in {node_dir()}: Node agents would call their hosts directly, uncaptured",
            "lcap setup node (needs npm and the npm registry, once)",
        )
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env.update(preload_env(), HTTPS_PROXY="http://127.0.0.1:9", LCAP_DEBUG="1")
    env["NODE_OPTIONS"] = node_options(None)
    code, out, err = _run_client([node, "-e", _PRELOAD_PROBE], env)
    if code or out.strip() != "EnvHttpProxyAgent":
        return Result.fail(
            f"the preload {PRELOAD} did not route fetch through the proxy: {_last_line(err) if err.strip() else out}",
            "lcap setup node; if it persists, run with LCAP_DEBUG=1 to see the preload's error",
        )
    return Result.ok(f"preload routes fetch and http(s) ({', '.join(f'{n} {v}' for n, v in PACKAGES.items())})")


# --- the spool ------------------------------------------------------------------------------------


def _spool_root() -> Path:
    return lcap_home() / "spool"


@check("spool.key", section="capture", required=True)
def spool_key_check(ctx: Context) -> Result:
    path = _spool_root() / KEY_NAME
    if not path.exists():
        return Result.skip(f"no spool key yet ({path} is made by the first proxy)")
    st = path.stat()
    if st.st_size != 32:
        return Result.fail(
            f"{path} is damaged ({st.st_size} bytes, not 32): no spool can be sealed or read",
            f"rm {path} and the spools it sealed ({_spool_root()}/*-*): their turns are lost; lcap makes a new key",
        )
    if st.st_mode & 0o077:
        return Result.fail(
            f"{path} is mode {st.st_mode & 0o777:04o}: others can unseal spooled calls", f"chmod 600 {path}"
        )
    return Result.ok(f"{path} (0600)")


@check("spool.backlog", section="capture", required=True)
def spool_backlog(ctx: Context) -> Result:
    """Turns waiting in spools: a proxy that died leaves them for the next proxy on its store; a live proxy whose
    writer falls far behind has a store it cannot write."""
    root = _spool_root()
    spools = backlogs(root)
    problems, fixes = [], []
    now = time.time()
    for spool in spools:
        if not spool.waiting:
            continue
        size = f"{spool.waiting} turns ({spool.waiting_bytes / 1e6:.1f} MB)"
        age = now - spool.oldest if spool.oldest else 0.0
        if spool.owner is None or not alive(spool.owner):
            problems.append(f"{size} of a proxy that ended (pid {spool.owner}) wait in {spool.directory}")
            fixes.append(f"run any lcap proxy on that store to store them: lcap proxy --db {spool.store} -- true")
        elif spool.waiting > BACKLOG_RECORDS or age > BACKLOG_SECONDS:
            problems.append(f"the writer of proxy {spool.owner} is {size} behind, the oldest {age:.0f} s old")
            fixes.append(
                f"something holds {spool.store} (a DuckDB shell, `lcap sql --write`, a notebook): close it; "
                "`lcap status` shows the writer"
            )
    waiting = sum(s.waiting for s in spools)
    details = {"spools": len(spools), "waiting": waiting}
    if problems:
        return Result.fail("; ".join(problems), "; ".join(dict.fromkeys(fixes)), **details)
    return Result.ok(
        f"{len(spools)} spool(s), {waiting} turns being written" if spools else "no spool waiting", **details
    )


@check("spool.disk", section="capture", required=False)
def spool_disk_room(ctx: Context) -> Result:
    """Room on the spool's file system: a full one holds finished turns in the proxy's memory (bounded by
    --max-spool-backlog) until it takes writes again, and past that bound turns are lost."""
    root = _spool_root()
    free, total, nearly_full = spool_disk(root)
    details = {"free_bytes": free, "total_bytes": total}
    if nearly_full:
        return Result.warn(
            f"the spool's disk ({root}) is nearly full: {free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB "
            f"(lcap wants {SPOOL_MIN_FREE_BYTES >> 20} MiB and {SPOOL_MIN_FREE_FRACTION:.0%} free)",
            "free space there, or set LCAP_HOME to a larger disk; while it is full, turns wait in the proxy's "
            "memory (--max-spool-backlog) and past that are lost",
            **details,
        )
    return Result.ok(f"{free / 2**30:.1f} GiB free on the spool's disk ({root})", **details)


# --- --transparent's prerequisites ------------------------------------------------------------------


SBIN = ("/usr/sbin", "/sbin")  # where system tools live when a user's PATH leaves them out


def _find(tool: str) -> str | None:
    return shutil.which(tool) or next((path for d in SBIN if os.access(path := os.path.join(d, tool), os.X_OK)), None)


@check("transparent.iptables", section="optional", required=False)
def iptables(ctx: Context) -> Result:
    found = _find("iptables")
    if found is None:
        return Result.fail(
            "iptables is not installed (needed only by --transparent capture)", "apt-get install iptables"
        )
    code, out, err = _run_client([found, "--version"], dict(os.environ))
    if code:
        return Result.fail(
            f"{found} --version: {_last_line(err)}", "reinstall iptables (apt-get install --reinstall iptables)"
        )
    return Result.ok(out.strip() or found)


@check("transparent.netns", section="optional", required=False)
def namespaces(ctx: Context) -> Result:
    unshare = _find("unshare")
    if unshare is None:
        return Result.fail(
            "unshare is not installed (needed only by --transparent capture)", "apt-get install util-linux"
        )
    argv = [unshare, "--net", "--mount", "true"]
    if os.geteuid() != 0:
        argv.insert(1, "--map-root-user")
    code, _, err = _run_client(argv, dict(os.environ))
    if code:
        return Result.fail(
            f"cannot make a network namespace: {_last_line(err)}",
            "run as root, or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)",
        )
    return Result.ok("network and mount namespaces can be made" + (" (as root)" if os.geteuid() == 0 else ""))


# --- --sandbox's prerequisites ------------------------------------------------------------------------


@check("sandbox.bubblewrap", section="optional", required=False)
def bubblewrap(ctx: Context) -> Result:
    reason = sandbox_missing()
    if reason is not None:
        fix = f"apt-get install {PACKAGE}" if shutil.which("bwrap") is None else "run lcap as root on cgroups v1"
        return Result.fail(f"{reason} (needed only by collect --sandbox)", fix)
    argv = ["bwrap", *NAMESPACES, "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "true"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return Result.fail("bwrap did not end within 30 s", "run `bwrap --ro-bind / / true` by hand to see why")
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return Result.fail(f"bwrap cannot make a sandbox: {last}", "run as root on a kernel with namespaces")
    version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    return Result.ok(f"{version or 'bwrap'}: a sandbox can be made")


# --- a live round trip ----------------------------------------------------------------------------------


_ANSWER = "lcap doctor's stand-in answers"


class _StandIn(_QuietHandler):
    """The smallest OpenAI-style server: a model list and one chat completion."""

    def do_GET(self) -> None:
        self._json({"object": "list", "data": [{"id": "stand-in", "object": "model", "owned_by": "lcap-doctor"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._json(
            {
                "id": "chatcmpl-doctor",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "stand-in",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": _ANSWER}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
            }
        )

    def _json(self, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def _stand_in() -> Iterator[str]:
    with _serving(_QuietServer(("127.0.0.1", 0), _StandIn), "lcap-doctor-stand-in") as port:
        yield f"http://127.0.0.1:{port}"


@check("roundtrip", section="capture", required=True, needs=("ca",), timeout=120)
def roundtrip(ctx: Context) -> Result:
    """A chat call to https://api.openai.com through a throwaway proxy (TLS with lcap's CA, episode credentials)
    to a local stand-in, then its turn read back from a scratch store: the whole capture path, writer included."""
    cert, _ = ca_files()
    started = time.perf_counter()
    with _stand_in() as upstream:
        store = Store(ctx.scratch / "roundtrip.duckdb", timeout=30)
        proxy = CaptureProxy(store, ProxyOptions(upstream=upstream))
        try:
            proxy.start()
        except LcapError as exc:
            return Result.fail(f"the proxy did not start: {exc}", "run `lcap proxy -- true` to see the same error")
        episode = f"lcap-doctor-{os.getpid()}"
        try:
            tls = ssl.create_default_context(cafile=str(ca_bundle(cert)))
            with httpx.Client(proxy=proxy.proxy_url(episode), verify=tls, trust_env=False, timeout=30) as client:
                answer = client.post(
                    "https://api.openai.com/v1/chat/completions",
                    json={"model": "gpt-doctor", "messages": [{"role": "user", "content": "are you there?"}]},
                    headers=bearer(os.urandom(16).hex()),  # a client's key, made up here: the stand-in reads none
                )
            if answer.status_code != 200 or _ANSWER not in answer.text:
                return Result.fail(
                    f"the call through the proxy got HTTP {answer.status_code}: {answer.text[:200]}",
                    "run `lcap proxy --upstream URL -- curl ...` by hand to see the same answer",
                )
            if not proxy.flush(timeout=30):
                return Result.fail(
                    "the call was answered but its turn was not in the store within 30 s",
                    "the turn writer does not run: check that `python -I -m lcap.capture.storage.writer --help` works",
                )
            rows = store.fetchall(
                "SELECT episode_id, model_requested, status_code FROM turns WHERE episode_id = ?", [episode]
            )
        except (httpx.HTTPError, ssl.SSLError) as exc:  # a bundle a client cannot load fails here too
            return Result.fail(
                f"the call through the proxy failed: {exc.__class__.__name__}: {exc}",
                "see `lcap doctor ca trust` first; then run `lcap proxy -- curl ...` by hand",
            )
        finally:
            proxy.stop()
    if rows != [(episode, "gpt-doctor", 200)]:
        return Result.fail(f"the stored turn is not the call that was made: {rows}", "report this as a bug in lcap")
    seconds = time.perf_counter() - started
    return Result.ok(
        f"https://api.openai.com -> throwaway proxy -> local stand-in: answered, stored, read back ({seconds:.1f} s)"
    )
