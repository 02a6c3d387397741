"""`lcap doctor`'s checks of capture's spool (its key, what waits in it), what `--transparent` and `--sandbox` need,
and a live round trip through a throwaway proxy. lcap's CA and each client's trust in it are checked by
capture/doctor_trust.py.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from lcap.capture.doctor_trust import QuietHandler, QuietServer, last_line, run_client, serving
from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.capture.sandbox import NAMESPACES, PACKAGE
from lcap.capture.sandbox import missing as sandbox_missing
from lcap.capture.storage.spool import KEY_NAME, SPOOL_MIN_FREE_BYTES, SPOOL_MIN_FREE_FRACTION, backlogs, spool_disk
from lcap.capture.trust.ca import ca_bundle, ca_files
from lcap.config import LcapError, lcap_home
from lcap.doctor import Context, Result, check
from lcap.policy import bearer
from lcap.processes import alive
from lcap.store import Store

BACKLOG_RECORDS = 10_000  # a live proxy's writer this many turns behind is stuck, not busy
BACKLOG_SECONDS = 120.0  # ... or whose oldest waiting turn is this old


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
    code, out, err = run_client([found, "--version"], dict(os.environ))
    if code:
        return Result.fail(
            f"{found} --version: {last_line(err)}", "reinstall iptables (apt-get install --reinstall iptables)"
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
    code, _, err = run_client(argv, dict(os.environ))
    if code:
        return Result.fail(
            f"cannot make a network namespace: {last_line(err)}",
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


class _StandIn(QuietHandler):
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
    with serving(QuietServer(("127.0.0.1", 0), _StandIn), "lcap-doctor-stand-in") as port:
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
