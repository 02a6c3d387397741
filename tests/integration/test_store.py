"""The store: schema versions and migrations, batched appends, processes taking turns at the file."""

from __future__ import annotations

import subprocess
import sys
import time

from lcap.store import Store

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
