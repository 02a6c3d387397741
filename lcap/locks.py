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
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise LcapError(f"another lcap (pid {holder}) is {doing}: try again when it is done") from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
