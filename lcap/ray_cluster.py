"""Joining a Ray cluster (`--ray ADDRESS`): the one place that knows what an unreachable cluster says.

Ray is the `ray` extra (`pip install -e '.[ray]'`). `ray.init` on an address with nobody listening
retries for a long while before it fails with a page of logs, so a `host:port` address is probed
first and a cluster that is not there is a one-line error naming the address tried.
"""

from __future__ import annotations

import logging
import os
import socket

from lcap.config import LcapError

PROBE_TIMEOUT_S = 5.0


def connect(address: str) -> None:
    """Join the Ray cluster at ADDRESS (`host:port`, `ray://host:port`, `auto` or `local`) for this process."""
    try:
        import ray  # the ray extra
    except ImportError:
        raise LcapError("--ray needs the ray extra: pip install -e '.[ray]' (scripts/setup.sh does)") from None
    if ray.is_initialized():
        return
    tried = describe(address)
    host_port = address.removeprefix("ray://")
    if address not in ("auto", "local") and ":" in host_port:
        host, _, port = host_port.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
        except (OSError, ValueError) as exc:
            raise LcapError(f"no Ray cluster at {tried}: {exc}") from None
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LcapError(f"cannot join the Ray cluster at {tried}: {first}") from None


def describe(address: str) -> str:
    """The address as tried: `auto` says which RAY_ADDRESS it read."""
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        return f"auto (RAY_ADDRESS={os.environ['RAY_ADDRESS']})"
    return address
