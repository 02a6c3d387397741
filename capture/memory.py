"""Memory given back to the system after big bodies.

A body of tens of megabytes, buffered and then freed, leaves the proxy's resident memory high: CPython
frees it, but glibc keeps freed heap pages (per thread arena, and below a threshold that grows with use)
for reuse, and a flow that ended inside a reference cycle waits for the next full collection (lcap freezes
the objects made at start-up, so those are rare). Every `TRIM_EVERY` seconds the proxy looks at its
resident memory; when it is `TRIM_GROWTH` above its floor (the lowest seen since the last trim, or what
that trim left), a collection and `malloc_trim` hand the freed memory back, and what is left becomes the
floor: memory in real use is not trimmed again and again. Elsewhere than glibc this does nothing.
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
        self.trims = 0
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
            if resident > self.floor + TRIM_GROWTH:
                gc.collect()
                self._trim(0)
                self.trims += 1
                self.floor = resident_bytes() or resident
            else:
                self.floor = min(self.floor, resident)
        self._timer = loop.call_later(TRIM_EVERY, self._tick, loop)
