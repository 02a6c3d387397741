"""What `lcap proxy` does: one episode around one child command, or a long-running shared proxy."""

from __future__ import annotations

import gc
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import replace
from pathlib import Path

from lcap.capture.options import ProxyOptions, SandboxLimits, sandbox_limits
from lcap.capture.proxy.server import CaptureProxy
from lcap.capture.reach.node_preload import ensure_node_capture
from lcap.capture.sandbox import Sandbox, limits_text
from lcap.capture.sandbox import missing as sandbox_missing
from lcap.capture.storage.writer import WriterReport
from lcap.capture.trust.credentials import records_dir
from lcap.capture.trust.destinations import is_loopback_host
from lcap.config import LcapError, lcap_home
from lcap.processes import ChildExit, python_helper, run_child
from lcap.store import Store


def _start(store: Store, options: ProxyOptions) -> CaptureProxy:
    proxy = CaptureProxy(store, options)
    proxy.start()
    # mitmproxy, TLS and lcap leave many long-lived objects; a full collection walking them would stop every call
    # in flight. Frozen, they are out of the collector's sight (benchmarks/bench_gc_freeze.py measures it).
    gc.freeze()
    return proxy


def run_proxy(
    command: list[str], *, labels: dict[str, str], episode: str | None, db: Path, options: ProxyOptions
) -> int:
    """Run `command` as one episode behind a fresh proxy; return its exit code. At the end, say on stderr how
    many of its turns were stored (a warning, and a `turns_unstored` flag on the episode, if some were not)."""
    if options.implicit_reward:
        raise LcapError("--implicit-reward judges the sessions of `lcap proxy --serve`: add --serve")
    if options.sandbox and ((reason := sandbox_missing()) or options.transparent):
        raise LcapError(reason or "--sandbox and --transparent both put the agent in namespaces: choose one")
    if not options.transparent:  # in its namespace every call reaches lcap: Node needs no preload there
        ensure_node_capture(command)
    store = Store(db)
    proxy = _start(store, options)
    episode_id = episode or str(uuid.uuid4())
    try:
        store.start_episode(episode_id, command=shlex.join(command), cwd=os.getcwd(), labels=labels)
    except BaseException:  # an id that exists already: that episode is left as it is
        proxy.stop()
        raise
    status, code, error = "failed", None, None
    report = None
    try:
        if options.transparent and not shutil.which(command[0]):  # else the namespace's start says it, exit 127
            raise LcapError(f"cannot run {shlex.join(command)}: command not found")
        limits = sandbox_limits(options)
        with proxy.episode_child(episode_id, command) as child:
            if limits is None:
                ended = run_child(child.argv, child.env, pass_fds=child.pass_fds, on_start=child.on_start)
            else:
                ended, reached = _run_sandboxed(proxy, episode_id, command, child.env, limits, db)
                if reached:
                    store.flag_episode(episode_id, "sandbox_limit", reached)
                    error = limits_text(reached)
        code = ended.code
        status = "interrupted" if ended.signals else ("ok" if code == 0 and error is None else "failed")
    except BaseException as exc:
        status, error = "error", str(exc) or exc.__class__.__name__
        raise
    finally:
        report = proxy.stop()
        store.end_episode(episode_id, status=status, exit_code=code, error=error)
        if report is not None and (report.unstored or report.lost):
            store.flag_episode(episode_id, "turns_unstored", _unstored_details(report))
            if error is not None:  # the summary below is not printed: the warning still is
                print(report.summary(db), file=sys.stderr, flush=True)
    if report is not None:
        print(report.summary(db), file=sys.stderr, flush=True)
    return code


def _run_sandboxed(
    proxy: CaptureProxy, episode_id: str, command: list[str], env: dict[str, str], limits: SandboxLimits, db: Path
) -> tuple[ChildExit, dict[str, object]]:
    """`lcap proxy --sandbox -- CMD`: CMD in a sandbox whose workspace is a copy of the current folder (lcap's home
    and the store left out), in a folder of its own that is removed at the end, or kept and printed with
    --keep-workspaces; (its exit, the limits it reached)."""
    folder = Path(tempfile.mkdtemp(prefix=f"lcap-sandbox-{episode_id[:8]}-"))
    folder.chmod(0o755)  # the agent runs as nobody
    workdir = folder / "work"
    box = Sandbox(limits, proxy, [], [db]).episode(episode_id, workdir)
    try:
        box.prepare()
        shutil.copytree(Path.cwd(), workdir, symlinks=True, dirs_exist_ok=True, ignore=_not_copied(db))
        box.own()
        child, child_env = box.child(command, {**env, "LCAP_WORKDIR": str(workdir)}, proxy.port or 0)
        ended = run_child(child.argv, child_env, pass_fds=child.pass_fds, on_start=child.on_start, cwd=workdir)
        return ended, box.limits_reached()
    finally:
        box.close()
        if limits.keep_workspaces:
            print(f"lcap: the sandbox's workspace is kept in {workdir}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)


def _not_copied(db: Path):
    """copytree's `ignore`: what the sandbox hides stays out of its workspace (lcap's home, the store's files)."""
    home, store = lcap_home().resolve(), Path(db).resolve()

    def ignore(folder: str, names: list[str]) -> set[str]:
        here = Path(folder).resolve()
        return {n for n in names if here / n == home or (here == store.parent and n.startswith(store.name))}

    return ignore


def _unstored_details(report: WriterReport) -> dict[str, object]:
    return {"unstored": report.unstored, "lost": report.lost, "spooled": report.spooled, "spool": str(report.spool)}


def serve_proxy(*, db: Path, options: ProxyOptions) -> None:
    """Serve until SIGINT/SIGTERM, then write every finished turn and exit. On a loopback address, calls without
    episode credentials are attributed by their session header or conversation (capture/proxy/sessions.py) unless
    `--require-credentials`. Rewards are taken over HTTP (capture/proxy/rewards_api.py) unless --rewards-port -1."""
    if options.sandbox:
        raise LcapError("--sandbox runs one command in a sandbox: give it after -- (lcap proxy --sandbox -- CMD)")
    if options.require_credentials is None and is_loopback_host(options.host):
        options = replace(options, require_credentials=False)
    if options.conversations is None:
        options = replace(options, conversations=True)
    if options.rewards_port is None:
        options = replace(options, rewards_port=0)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    proxy = _start(Store(db), options)
    try:
        judge, watching = _start_implicit(db, options.implicit_reward) if options.implicit_reward else (None, "")
    except BaseException:
        proxy.stop()
        raise
    anonymous = (
        "refused (407)"
        if proxy.require_credentials
        else "placed by session header or conversation"
        if options.conversations
        else "placed by session header, else unattributed"
    )
    print(
        f"lcap proxy listening on {proxy.url} (store {db}; token ids {'on' if proxy.token_ids else 'off'}; "
        f"calls without episode credentials {anonymous})",
        flush=True,
    )
    print(
        f"  clients: HTTPS_PROXY=$(lcap episode new --port {proxy.port})  "
        f"SSL_CERT_FILE={proxy.child_env(None)['SSL_CERT_FILE']}",
        flush=True,
    )
    if proxy.rewards is not None:
        print(
            f"  rewards: POST {proxy.rewards.url} (Authorization: Bearer, the reward token in "
            f"{records_dir() / f'{proxy.port}.json'} or a tenant's upstream credential)",
            flush=True,
        )
    if judge is not None:
        print(f"  implicit rewards: {watching}", flush=True)
        threading.Thread(target=_pass_on, args=(judge.stdout,), name="lcap-judge-live", daemon=True).start()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        if judge is not None:
            _stop_implicit(judge)
        report = proxy.stop()
        if report is not None:
            print(report.summary(db), file=sys.stderr, flush=True)


_READY = "lcap judge-live: watching"  # its first line (lcap.dataset.judge.implicit.READY)
IMPLICIT_READY_S = 120.0  # for `lcap judge-live` to check its rubric and judge and start its capture proxy
IMPLICIT_STOP_S = 15.0  # for it to end once its standard input closed (a judge call in flight is cut after)


def _start_implicit(db: Path, spec: str) -> tuple[subprocess.Popen, str]:
    """`--implicit-reward SPEC`: `lcap judge-live SPEC` as a child process (the dataset stage's command: capture
    imports none of it), watching this store until its standard input closes, which this proxy's end (any end)
    does. Returns once it said it watches, with what it said."""
    argv = python_helper(sys.executable, "-m", "lcap", "judge-live", *shlex.split(spec))
    argv += ["--db", str(db), "--until-stdin-closes"]
    try:
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    except OSError as exc:
        raise LcapError(f"--implicit-reward: cannot start lcap judge-live: {exc.strerror or exc}") from None
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], IMPLICIT_READY_S)
    line = child.stdout.readline() if ready else ""
    if not line.startswith(_READY):
        _stop_implicit(child)
        raise LcapError(f"--implicit-reward: lcap judge-live did not start (exit {child.returncode}): see above")
    return child, line.strip()


def _pass_on(lines) -> None:
    for line in lines:
        print(f"  {line.rstrip()}", flush=True)


def _stop_implicit(child: subprocess.Popen) -> None:
    try:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(IMPLICIT_STOP_S)
    except (OSError, subprocess.TimeoutExpired):
        child.terminate()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
