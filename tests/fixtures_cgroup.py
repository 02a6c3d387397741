"""A memory cgroup (cgroups v1) for a test's child processes: a regression that makes them hold too much memory gets
them killed by the kernel, and the test fails, instead of the machine swapping or its OOM killer picking a victim.

    with memory_cgroup(400 << 20) as group:
        proc = subprocess.Popen([...], preexec_fn=group.join)
        ...
        assert group.peak() < 300 << 20 and not group.oom_kills()

The child joins the group before it runs its program, so everything it starts (lcap's writer process) is in the
group too. Tests that need one are skipped where cgroups v1's memory controller is not writable (not root).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
_names = itertools.count()


class MemoryCgroup:
    def __init__(self, path: Path) -> None:
        self.path = path

    def join(self) -> None:
        """Move the calling process into the group (a `preexec_fn`: the child, before it runs its program)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        """The most memory the group held at once, in bytes (page cache included)."""
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed for memory."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
        return 0

    def pids(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A fresh memory cgroup of `limit` bytes (swap included where the kernel counts it), removed afterwards with
    whatever still runs in it killed."""
    if not (MEMORY_ROOT / "cgroup.procs").exists() or not os.access(MEMORY_ROOT, os.W_OK):
        pytest.skip("needs cgroups v1's memory controller, writable (root)")
    path = MEMORY_ROOT / f"lcap-test-{os.getpid()}-{next(_names)}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit))
        swap = path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit))
        yield MemoryCgroup(path)
    finally:
        group = MemoryCgroup(path)
        for _ in range(100):
            pids = group.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            path.rmdir()
