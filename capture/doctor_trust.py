"""`lcap doctor`'s checks of lcap's CA (there, private, in the bundle children get) and of each client's trust in it
through that bundle, and of the Node preload; the spool's, `--transparent`'s and `--sandbox`'s checks and the
live round trip are capture/doctor.py's (listed after these: capture/commands.py registers this module first).

The trust checks run each client against a local TLS server whose certificate lcap's CA signed, with the
environment lcap gives its children (`trust_env`): a client that does not trust it there would not trust the
proxy either.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509

from lcap.capture.reach.agent_env import PROXY_VARS, trust_env
from lcap.capture.reach.jvm import TRUST_STORE
from lcap.capture.reach.node_preload import PACKAGES, PRELOAD, installed_version, node_dir, node_options, preload_env
from lcap.capture.trust.ca import CA_BASENAME, ca_bundle, ca_dir, ca_files, ensure_ca
from lcap.capture.trust.certs import LeafCerts
from lcap.config import LcapError
from lcap.doctor import Context, Result, check
from lcap.processes import python_helper

CLIENT_TIMEOUT = 30.0  # seconds a client gets to fetch one page from the local TLS server


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


class QuietHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass


class _Page(QuietHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that does not trust the certificate hangs up mid-handshake: that is what is being checked."""


@contextmanager
def _tls_server() -> Iterator[str]:
    """A local HTTPS server on 127.0.0.1 whose certificate lcap's CA signed; yields its URL."""
    context = LeafCerts(ca_dir(), CA_BASENAME, 4).context("127.0.0.1")
    server = QuietServer(("127.0.0.1", 0), _Page)
    server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    with serving(server, "lcap-doctor-tls") as port:
        yield f"https://127.0.0.1:{port}/lcap-doctor"


@contextmanager
def serving(server: QuietServer, name: str) -> Iterator[int]:
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


def run_client(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[int, str, str]:
    try:
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    except subprocess.TimeoutExpired:
        return 124, "", f"no answer within {CLIENT_TIMEOUT:g} s"
    except OSError as exc:
        return 127, "", str(exc)
    return done.returncode, done.stdout, done.stderr


def last_line(text: str) -> str:
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
    _code, out, err = run_client(python_helper(sys.executable, "-c", _PYTHON_CLIENTS, url), _client_env(ctx))
    try:
        clients = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Result.fail(f"the Python client did not run: {last_line(err)}", f"run {sys.executable} -c 'import ssl'")
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
    code, _, err = run_client(argv, _client_env(ctx))
    if code:
        return Result.fail(
            f"curl: {last_line(err)}",
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
    _code, out, err = run_client([node, "-e", _NODE_CLIENTS, url], _client_env(ctx))
    try:
        clients = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Result.fail(f"node did not run: {last_line(err)}", "check that `node -e 1` runs")
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
    code, out, err = run_client([java, str(source), url], env, cwd=ctx.scratch)
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
    return last_line(text)


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
    code, out, err = run_client([node, "-e", _PRELOAD_PROBE], env)
    if code or out.strip() != "EnvHttpProxyAgent":
        return Result.fail(
            f"the preload {PRELOAD} did not route fetch through the proxy: {last_line(err) if err.strip() else out}",
            "lcap setup node; if it persists, run with LCAP_DEBUG=1 to see the preload's error",
        )
    return Result.ok(f"preload routes fetch and http(s) ({', '.join(f'{n} {v}' for n, v in PACKAGES.items())})")
