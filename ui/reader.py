"""The UI's only way into the store: read-only units of work, and one shared watch for live updates.

The UI never writes and never keeps the file: each page attaches the store read-only for the time
of its queries and detaches it (lcap.store's discipline), so a proxy's writer, a verifier or the
trainer can write between two page loads. While one of them holds the file a page waits up to the
UI's `--store-timeout`, then says the store is busy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio.to_thread
import duckdb

from lcap.store import Store
from lcap.ui import queries


class Reader:
    """Read-only access to one store, shared by the app's threads."""

    def __init__(self, db: Path, *, timeout: float) -> None:
        self.store = Store(db, timeout=timeout)

    @contextmanager
    def read(self) -> Iterator[tuple[duckdb.DuckDBPyConnection, dict[str, set[str]]]]:
        """One read-only unit of work: the connection and the store's tables with their columns."""
        with self.store.connect(read_only=True) as con:
            yield con, queries.columns(con)


class Watch:
    """The store's fingerprint, checked at most once per `interval` however many pages listen.

    Every live page (an EventSource on /events) waits on the same check, so N open tabs cost one
    read-only attach per interval, not N."""

    def __init__(self, reader: Reader, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.reader = reader
        self.interval = interval
        self.clock = clock
        self._lock = asyncio.Lock()
        self._at = -1e9
        self._value: tuple[int, ...] | None = None
        self._error: str | None = None

    def _read(self) -> tuple[int, ...]:
        with self.reader.read() as (con, _):
            return queries.fingerprint(con)

    async def current(self) -> tuple[tuple[int, ...] | None, str | None]:
        """(fingerprint, None), or (last known, error) when the store could not be read this time."""
        async with self._lock:
            if self.clock() - self._at >= self.interval:
                try:
                    self._value, self._error = await anyio.to_thread.run_sync(self._read), None
                except Exception as exc:  # a locked or moved store: reported to the page, retried next time
                    self._error = str(exc).splitlines()[0][:300]
                self._at = self.clock()
            return self._value, self._error
