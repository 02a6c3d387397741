"""The store: schema versions and migrations, batched appends, processes taking turns at the file."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lcap.store import Store, now

# A process with a backlog (as the turn writer has one): it attaches the store again the moment it detaches.
BACKLOG = """
import sys, time
from lcap.store import Store
store = Store(sys.argv[1])
for i in range(int(sys.argv[2])):
    with store.connect():
        if i == 0:
            print("attached", flush=True)
        time.sleep(float(sys.argv[3]))
"""


def test_a_process_waiting_for_the_store_gets_it_before_one_with_a_backlog(tmp_path):
    """DuckDB's lock is no queue: a process retrying while another detaches and attaches again at once would get
    in only when a retry fell into that instant. The one waiting goes first (`_Waiters`): each of three attaches
    waits for the holder's current unit of work at most, however many follow it."""
    path = tmp_path / "s.duckdb"
    store = Store(path)
    store.execute("SELECT 1")  # the file and its schema
    hold, cycles = 0.3, 30
    holder = subprocess.Popen(
        [sys.executable, "-c", BACKLOG, str(path), str(cycles), str(hold)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "attached"
        waits = []
        for _ in range(3):
            t0 = time.monotonic()
            with store.connect():
                waits.append(time.monotonic() - t0)
            time.sleep(0.05)
        assert holder.poll() is None, "the holder ended before the checks: no backlog was left to wait behind"
        assert max(waits) < 3 * hold, waits  # without the queue: one attach in a few gets in within a few holds
    finally:
        holder.kill()
        holder.wait()


# A process that appends a row once the store is its: it says when it starts to wait for it.
APPENDER = """
import sys
from lcap.store import Store, now
store = Store(sys.argv[1])
print("waiting", flush=True)
store.append("rewards", [{"episode_id": "waiter", "value": 1.0, "source": "t", "created_at": now()}])
print("stored", flush=True)
"""
IN_OPEN = 0x20


def _opens(path: Path) -> Callable[[], int]:
    """A count of the opens of `path` by any process from now on (inotify, read through libc)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0 and libc.inotify_add_watch(fd, str(path).encode(), IN_OPEN) >= 0, os.strerror(ctypes.get_errno())
    seen = [0]

    def count() -> int:
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return seen[0]
            at = 0
            while at < len(data):
                _, mask, _, size = struct.unpack_from("iIII", data, at)
                seen[0] += bool(mask & IN_OPEN)
                at += 16 + size

    return count


def test_a_process_waiting_for_the_store_opens_its_file_only_once_the_holder_has_closed_it(tmp_path):
    """DuckDB reads a file's headers before it takes its lock, and never again after: an attach that read them while
    another process checkpointed, and got the lock the moment that process let go, would work from the headers the
    checkpoint replaced, and its own checkpoint would write over the blocks just written (a serving proxy's turns,
    counted stored, were gone after `lcap loop --live` and its collects wrote the same store). A process waiting
    for the store waits on lcap's own lock (STORE.lock), not in DuckDB's open: not one open of the file while
    another process holds it, and nobody's rows lost."""
    path = tmp_path / "s.duckdb"
    store = Store(path)
    store.execute("SELECT 1")  # the file and its schema
    with store.connect():
        store.append("rewards", [{"episode_id": "holder", "value": 1.0, "source": "t", "created_at": now()}])
        opens = _opens(path)  # from here on: this process has the file open already
        waiter = subprocess.Popen([sys.executable, "-c", APPENDER, str(path)], stdout=subprocess.PIPE, text=True)
        assert waiter.stdout is not None and waiter.stdout.readline().strip() == "waiting"
        time.sleep(1.0)  # DuckDB's lock alone: the waiter tries (and opens the file) every 25 ms at most
        assert opens() == 0, "a waiting process opened the store's file while another held it"
        assert waiter.poll() is None
    assert waiter.stdout.readline().strip() == "stored" and waiter.wait(30) == 0
    assert opens() > 0  # it opened the file once it was free: the count sees its opens
    rows = store.fetchall("SELECT episode_id FROM rewards ORDER BY episode_id")
    assert rows == [("holder",), ("waiter",)]
