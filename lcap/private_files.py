"""Files only their owner can read: the store and its WAL, which DuckDB creates with the process's umask.

While any unit of work that may create them is open, the process's umask is 077 (a process-wide setting,
so it is counted across threads and restored when the last one ends). Children lcap starts get the
umask the user had (`USER_UMASK`), whatever a thread of lcap is doing at that moment.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

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
