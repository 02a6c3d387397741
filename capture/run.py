"""What `lcap proxy` does: one episode around one child command, or a long-running shared proxy."""

from __future__ import annotations

import gc
import os
import shlex
import signal
import sys
import threading
import uuid
from pathlib import Path

from lcap.capture.options import ProxyOptions
from lcap.capture.redact import redact_text
from lcap.capture.server import CaptureProxy
from lcap.processes import run_child
from lcap.store import Store


def _start(db: Path, options: ProxyOptions) -> CaptureProxy:
    proxy = CaptureProxy(Store(db), options)
    proxy.start()
    # mitmproxy, TLS and lcap leave many long-lived objects; a full collection walking them would stop every call
    # in flight. Frozen, they are out of the collector's sight (benchmarks/bench_gc_freeze.py measures it).
    gc.freeze()
    return proxy


def run_proxy(
    command: list[str], *, labels: dict[str, str], episode: str | None, db: Path, options: ProxyOptions
) -> int:
    """Run `command` as one episode behind a fresh proxy; return its exit code."""
    proxy = _start(db, options)
    episode_id = episode or str(uuid.uuid4())
    store = proxy.store
    status, code, error = "failed", None, None
    try:
        store.start_episode(episode_id, command=redact_text(shlex.join(command)), cwd=os.getcwd(), labels=labels)
        ended = run_child(command, proxy.child_env(episode_id))
        code = ended.code
        status = "interrupted" if ended.signals else ("ok" if code == 0 else "failed")
    except BaseException as exc:
        status, error = "error", str(exc) or exc.__class__.__name__
        raise
    finally:
        proxy.stop()
        store.end_episode(episode_id, status=status, exit_code=code, error=error)
    return code


def serve_proxy(*, db: Path, options: ProxyOptions) -> None:
    """Serve until SIGINT/SIGTERM, then write every finished turn and exit."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    proxy = _start(db, options)
    print(
        f"lcap proxy listening on {proxy.url} (store {db}; token ids {'on' if proxy.token_ids else 'off'})", flush=True
    )
    print(
        f"  clients: HTTPS_PROXY=http://EPISODE:x@{options.host}:{proxy.port}  SSL_CERT_FILE={proxy.child_env(None)['SSL_CERT_FILE']}",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        proxy.stop()
        print(f"lcap proxy stopped: {proxy.writer.written} turns written", file=sys.stderr, flush=True)
