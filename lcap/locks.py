"""A lock between processes on a file, held while one of them does what others must wait for (a change of the
policy server, a model conversion, a repository checkout), with a bounded wait."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from lcap.config import LcapError


@contextlib.contextmanager
def file_lock(path: Path, *, wait: float, doing: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (made if missing); another holder is waited for up to `wait` seconds, then
    refused with its pid and `doing` (what a holder does)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not flock_within(fd, fcntl.LOCK_EX, wait, pause=0.1):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise LcapError(f"another lcap (pid {holder}) is {doing}: try again when it is done")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def flock_within(fd: int, kind: int, timeout: float, *, pause: float = 0.005) -> bool:
    """Take a `kind` lock (`fcntl.LOCK_EX` or `LOCK_SH`) on `fd`, trying every `pause` seconds; False after
    `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
