"""Run the UI: check the store, bind the socket, print the address once, serve until Ctrl-C."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable
from pathlib import Path

import uvicorn

from lcap.config import LcapError
from lcap.store import Store
from lcap.ui.app import create_app
from lcap.ui.options import UiOptions


def bind(options: UiOptions) -> socket.socket:
    """The listening socket (bound here, so port 0 is known before the address is printed)."""
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((options.host.strip("[]"), options.port))
    except OSError as exc:
        sock.close()
        raise LcapError(f"cannot listen on {options.host}:{options.port}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def address(options: UiOptions, sock: socket.socket, token: str | None) -> str:
    host = options.host if ":" not in options.host.strip("[]") else f"[{options.host.strip('[]')}]"
    url = f"http://{host}:{sock.getsockname()[1]}/"
    return f"{url}?token={token}" if token else url


def serve(db: Path, options: UiOptions, *, echo: Callable[[str], None]) -> None:
    """Serve the UI over `db` until interrupted. A non-loopback host gets a fresh token, printed once."""
    with Store(db, timeout=options.store_timeout).connect(read_only=True):
        pass  # no store, or not a DuckDB file: one line now rather than on every page
    token = None if options.loopback else secrets.token_urlsafe(24)
    sock = bind(options)
    app = create_app(db, options, token=token)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=2, lifespan="off", ws="none"
    )
    echo(f"lcap ui: {address(options, sock, token)}  (store {db}, read-only; Ctrl-C stops)")
    if token:
        echo("lcap ui: listening beyond this machine: every request needs that token (it is not shown again)")
    uvicorn.Server(config).run(sockets=[sock])
