"""Files only their owner can read: the store and its WAL, which DuckDB creates with the process's umask.

While any unit of work that may create them is open, the process's umask is 077 (a process-wide setting,
so it is counted across threads and restored when the last one ends). Children lcap starts get the
umask the user had (`USER_UMASK`), whatever a thread of lcap is doing at that moment, and so do the files and
folders lcap makes for others to read (`user_mode`, `make_dirs`): a sandboxed agent and its verifier run as
another user.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

USER_UMASK = os.umask(0o022)
os.umask(USER_UMASK)

_lock = threading.Lock()
_holders = 0


@contextmanager
def private_files() -> Iterator[None]:
    """Files and directories created meanwhile are 0600 / 0700."""
    global _holders
    with _lock:
        if _holders == 0:
            os.umask(USER_UMASK | 0o077)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                os.umask(USER_UMASK)


def user_mode(path: Path) -> None:
    """Give `path` the mode the user's umask gives it (not the 077 a store write on another thread may hold now)."""
    path.chmod((0o777 if path.is_dir() else 0o666) & ~USER_UMASK)


def make_dirs(path: Path) -> None:
    """`path` and the folders above it that do not exist yet, each with the user's mode."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        user_mode(folder)
