"""Memory given back to the system after big bodies.

A body of tens of megabytes, buffered and then freed, leaves the proxy's resident memory high: CPython
frees it, but glibc keeps freed heap pages (per thread arena, and below a threshold that grows with use)
for reuse, and a flow that ended inside a reference cycle waits for the next full collection (lcap freezes
the objects made at start-up, so those are rare). Every `TRIM_EVERY` seconds the proxy looks at its
resident memory; when it is `TRIM_GROWTH` above its floor (the lowest seen since start: the idle proxy), a
collection and `malloc_trim` hand the freed memory back. Memory in real use cannot be handed back: a trim
that frees little doubles the wait before the next one (up to `TRIM_BACKOFF_MAX`), so a busy proxy is not
trimmed again and again, while memory freed later (a big body whose call ended after the last trim) is
still given back. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import os
from collections.abc import Callable

TRIM_EVERY = 5.0  # seconds
TRIM_GROWTH = 32 << 20  # bytes
TRIM_BACKOFF_MAX = 300.0  # seconds


def resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryTrimmer:
    """Runs on the proxy's event loop; `start` it once the proxy is up."""

    def __init__(self) -> None:
        self._trim: Callable[[int], int] | None
        try:
            self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None
        self.floor = resident_bytes()
        self._wait = TRIM_EVERY  # before the next trim
        self._next_trim = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._trim is not None and self.floor is not None:
            self._timer = loop.call_later(TRIM_EVERY, self._tick, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        resident = resident_bytes()
        if resident is not None and self.floor is not None and self._trim is not None:
            self.floor = min(self.floor, resident)
            if resident > self.floor + TRIM_GROWTH and loop.time() >= self._next_trim:
                gc.collect()
                self._trim(0)
                freed = resident - (resident_bytes() or resident)
                self._wait = TRIM_EVERY if freed >= TRIM_GROWTH // 4 else min(2 * self._wait, TRIM_BACKOFF_MAX)
                self._next_trim = loop.time() + self._wait
        self._timer = loop.call_later(TRIM_EVERY, self._tick, loop)
