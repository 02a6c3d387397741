"""The turn spool: every finished call is on disk the moment it finishes, before DuckDB sees it.

A spool is a directory per proxy (`LCAP_HOME/spool/PID-XXXXXXXX/`) holding numbered segments of
length-prefixed pickle records, plus a `store` file naming the DuckDB file the turns belong to.
The proxy appends one record per finished call with one `write`; the writer process reads the
segments in order and deletes each once its turns are in the store. A record written survives
anything that happens to lcap afterwards (kill -9 included): the writer process, or the next
proxy on the same store, still gets it into DuckDB.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("lcap.capture")

SEGMENT_BYTES = 32 << 20
_LENGTH = struct.Struct("<I")
_SUFFIX = ".turns"


def segment_path(directory: Path, number: int) -> Path:
    return directory / f"{number:08d}{_SUFFIX}"


def segments(directory: Path) -> list[int]:
    return sorted(int(p.name[: -len(_SUFFIX)]) for p in directory.glob(f"*{_SUFFIX}"))


def spool_store(directory: Path) -> str | None:
    """The resolved path of the store a spool's turns belong to (None if unreadable)."""
    try:
        return (directory / "store").read_text(encoding="utf-8")
    except OSError:
        return None


class SpoolAppender:
    """The proxy's side: append records, starting a new segment past `SEGMENT_BYTES`. Thread-safe."""

    def __init__(self, directory: Path, store_path: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "store").write_text(str(store_path.resolve()), encoding="utf-8")
        self.directory = directory
        self._lock = threading.Lock()
        self._segment = 0
        self._size = 0
        self._fd = self._open(1)

    def _open(self, number: int) -> int:
        fd = os.open(segment_path(self.directory, number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segment, self._size = number, 0
        return fd

    def append(self, record: Any) -> None:
        data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(_LENGTH.pack(len(data)) + data)
        with self._lock:
            if self._size and self._size + len(view) > SEGMENT_BYTES:
                os.close(self._fd)
                self._fd = self._open(self._segment + 1)
            self._size += len(view)
            while view:
                view = view[os.write(self._fd, view) :]

    def position(self) -> tuple[int, int]:
        """(segment, bytes) written so far: a reader at or past it has seen every record appended."""
        with self._lock:
            return self._segment, self._size

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)


class SpoolReader:
    """The writer's side: the records appended since the last `read`, in order."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        existing = segments(directory)
        self.segment = existing[0] if existing else 1
        self.offset = 0
        self.finished: list[int] = []  # fully read segments, to delete once their turns are stored

    def read(self) -> list[Any]:
        records: list[Any] = []
        while True:
            self._read_segment(records)
            if not segment_path(self.directory, self.segment + 1).exists():
                return records
            # The appender opens the next segment only after its last write to this one: read that too.
            self._read_segment(records)
            self.finished.append(self.segment)
            self.segment, self.offset = self.segment + 1, 0

    def _read_segment(self, records: list[Any]) -> None:
        try:
            with open(segment_path(self.directory, self.segment), "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return
        pos = 0
        while pos + _LENGTH.size <= len(data):
            (length,) = _LENGTH.unpack_from(data, pos)
            end = pos + _LENGTH.size + length
            if end > len(data):
                break  # being written, or cut by a crash: the rest comes with the next read
            try:
                records.append(pickle.loads(data[pos + _LENGTH.size : end]))
            except Exception as exc:  # one damaged record must not block the rest
                log.error("lcap: skipped an unreadable record in %s: %s", self.directory, exc)
            pos = end
        self.offset += pos

    def position(self) -> tuple[int, int]:
        return self.segment, self.offset

    def delete_finished(self) -> None:
        for number in self.finished:
            segment_path(self.directory, number).unlink(missing_ok=True)
        self.finished.clear()
