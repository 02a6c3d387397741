"""The turn spool: every finished call is on disk the moment it finishes, before DuckDB sees it.

A spool is a directory per proxy (`LCAP_HOME/spool/PID-XXXXXXXX/`, mode 0700) holding numbered
segments of length-prefixed records, a `store` file naming the DuckDB file the turns belong to, and a
`progress` file where the writer keeps how far it has stored them. The proxy appends one record per
finished call with one `write`; the writer process reads the segments in order and deletes each once
its turns are in the store. A record written survives anything that happens to lcap afterwards (kill -9
included): the writer process, its restart, or the next proxy on the same store still gets it into DuckDB.

Records hold raw request and response bytes, credentials included (redaction needs the parsed and
reassembled turn, which the writer builds). So they are encrypted (AES-256-GCM, a fresh nonce per
record) with a key kept beside the spools (`LCAP_HOME/spool/key`, 0600) that every proxy and writer on
this home shares, so a spool whose proxy and writer both died can still be replayed: no body reaches
the disk in plain text, and encrypting a record costs the proxy a few microseconds.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lcap.config import LcapError

log = logging.getLogger("lcap.capture")

SEGMENT_BYTES = 32 << 20
_LENGTH = struct.Struct("<I")
_SUFFIX = ".turns"
_ENCRYPTED = b"E"  # a record's first byte; a pickle (spools of lcap before encryption) starts with 0x80
_NONCE = 12
KEY_NAME = "key"


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


def private_dir(path: Path) -> Path:
    """Create `path` (and its parents) if needed; `path` itself ends up 0700 (one of lcap's own: a shared
    directory, sticky like /tmp or another user's, is left as it is)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_mode & 0o077 and not st.st_mode & stat.S_ISVTX and st.st_uid == os.getuid():
        path.chmod(0o700)
    return path


def spool_key(root: Path) -> AESGCM:
    """The spools' shared key under `root`, created (0600) by whichever process needs it first."""
    private_dir(root)
    path = root / KEY_NAME
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        tmp = root / f".{KEY_NAME}.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, AESGCM.generate_key(256))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and never replaces a key another process created meanwhile
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        key = path.read_bytes()
    if len(key) != 32:
        raise LcapError(f"spool key {path} is damaged ({len(key)} bytes): remove it and the spools it sealed")
    return AESGCM(key)


def seal(cipher: AESGCM, record: Any) -> bytes:
    nonce = os.urandom(_NONCE)
    return _ENCRYPTED + nonce + cipher.encrypt(nonce, pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL), None)


def unseal(cipher: AESGCM, payload: bytes) -> Any:
    """The record a spool payload holds (raises on a damaged one)."""
    if payload[:1] == _ENCRYPTED:
        payload = cipher.decrypt(payload[1 : 1 + _NONCE], payload[1 + _NONCE :], None)
    return pickle.loads(payload)


def reseal(source: AESGCM, target: AESGCM, payload: bytes) -> bytes:
    """A sealed record sealed again under another key (a Ray node's records, into the driver's spool). A record
    `source` cannot open is returned as it is: the writer keeps it as a dead letter, unreadable, but kept."""
    if payload[:1] != _ENCRYPTED:
        return payload
    try:
        plain = source.decrypt(payload[1 : 1 + _NONCE], payload[1 + _NONCE :], None)
    except Exception:
        return payload
    nonce = os.urandom(_NONCE)
    return _ENCRYPTED + nonce + target.encrypt(nonce, plain, None)


class SpoolAppender:
    """The proxy's side: append records, starting a new segment past `SEGMENT_BYTES`. Thread-safe.

    `store_path` names the store its writer fills (None: a Ray node's spool, which the driver empties);
    `cipher` seals the records (default: the key beside the spools)."""

    def __init__(self, directory: Path, store_path: Path | None, cipher: AESGCM | None = None) -> None:
        self.cipher = cipher or spool_key(directory.parent)
        private_dir(directory)
        if store_path is not None:
            fd = os.open(directory / "store", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, str(store_path.resolve()).encode())
            finally:
                os.close(fd)
        self.directory = directory
        self.appended = 0
        self._lock = threading.Lock()
        self._segment = 0
        self._size = 0
        self._fd = self._open(1)

    def _open(self, number: int) -> int:
        fd = os.open(segment_path(self.directory, number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segment, self._size = number, 0
        return fd

    def append(self, record: Any) -> None:
        self.append_payload(seal(self.cipher, record))

    def append_payload(self, data: bytes) -> None:
        """Append one sealed record (`append` seals it; tests write damaged ones with this)."""
        view = memoryview(_LENGTH.pack(len(data)) + data)
        with self._lock:
            if self._size and self._size + len(view) > SEGMENT_BYTES:
                os.close(self._fd)
                self._fd = self._open(self._segment + 1)
            self._size += len(view)
            while view:
                view = view[os.write(self._fd, view) :]
            self.appended += 1

    def position(self) -> tuple[int, int]:
        """(segment, bytes) written so far: a reader at or past it has seen every record appended."""
        with self._lock:
            return self._segment, self._size

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)


@dataclass
class Entry:
    """One record as read from the spool: where it is (its id in dead_letters) and its sealed bytes."""

    segment: int
    offset: int
    payload: bytes

    def record_id(self, directory: Path) -> str:
        return f"{directory.name}/{self.segment}/{self.offset}"


class SpoolReader:
    """The writer's side: the records appended since the last `read`, in order, from a starting position."""

    def __init__(self, directory: Path, start: tuple[int, int] | None = None) -> None:
        self.directory = directory
        existing = segments(directory)
        self.segment, self.offset = existing[0] if existing else 1, 0
        if start is not None and start[0] in existing:
            self.segment, self.offset = start
        # Fully read segments, to delete once their turns are stored (those before the start were, already).
        self.finished: list[int] = [n for n in existing if n < self.segment]

    def read(self, limit: int = 1 << 30, max_bytes: int = 1 << 62) -> list[Entry]:
        """Up to `limit` records (and about `max_bytes`); the rest stays for the next read."""
        entries: list[Entry] = []
        size = 0
        while len(entries) < limit and size < max_bytes:
            size += self._read_segment(entries, limit, max_bytes - size)
            if len(entries) >= limit or size >= max_bytes:
                break
            if not segment_path(self.directory, self.segment + 1).exists():
                break
            # The appender opens the next segment only after its last write to this one: read that too.
            size += self._read_segment(entries, limit, max_bytes - size)
            if len(entries) >= limit or size >= max_bytes:
                break
            self.finished.append(self.segment)
            self.segment, self.offset = self.segment + 1, 0
        return entries

    def _read_segment(self, entries: list[Entry], limit: int, max_bytes: int) -> int:
        try:
            with open(segment_path(self.directory, self.segment), "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()  # at most a segment: the appender starts a new one past SEGMENT_BYTES
        except FileNotFoundError:
            return 0
        pos = 0
        while pos + _LENGTH.size <= len(data) and len(entries) < limit and pos < max_bytes:
            (length,) = _LENGTH.unpack_from(data, pos)
            end = pos + _LENGTH.size + length
            if end > len(data):
                break  # being written, or cut by a crash: the rest comes with the next read
            entries.append(Entry(self.segment, self.offset + pos, data[pos + _LENGTH.size : end]))
            pos = end
        self.offset += pos
        return pos

    def position(self) -> tuple[int, int]:
        return self.segment, self.offset

    def delete_finished(self) -> None:
        for number in self.finished:
            segment_path(self.directory, number).unlink(missing_ok=True)
        self.finished.clear()


@dataclass
class Progress:
    """What the writer has stored from one spool, kept in the spool's `progress` file across writer restarts.

    `attempt_at`/`attempt_end`/`attempts`: the batch being stored and how many writers started storing it; a
    writer that dies in it leaves them there, so its successor takes those records one at a time.
    """

    position: tuple[int, int] | None = None
    stored: int = 0
    degraded: int = 0
    dead: int = 0
    attempt_at: tuple[int, int] | None = None
    attempt_end: tuple[int, int] | None = None
    attempts: int = 0

    @classmethod
    def load(cls, directory: Path) -> Progress:
        try:
            data = json.loads((directory / "progress").read_text(encoding="utf-8"))
            return cls(
                position=tuple(data["position"]) if data.get("position") else None,
                stored=int(data.get("stored", 0)),
                degraded=int(data.get("degraded", 0)),
                dead=int(data.get("dead", 0)),
                attempt_at=tuple(data["attempt_at"]) if data.get("attempt_at") else None,
                attempt_end=tuple(data["attempt_end"]) if data.get("attempt_end") else None,
                attempts=int(data.get("attempts", 0)),
            )
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("lcap: unreadable progress file in %s (%s): its records are stored again, once", directory, exc)
            return cls()

    def save(self, directory: Path) -> None:
        data = {
            "position": self.position,
            "stored": self.stored,
            "degraded": self.degraded,
            "dead": self.dead,
            "attempt_at": self.attempt_at,
            "attempt_end": self.attempt_end,
            "attempts": self.attempts,
        }
        tmp = directory / f".progress.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(data).encode())
        finally:
            os.close(fd)
        tmp.replace(directory / "progress")

    @property
    def handled(self) -> int:
        return self.stored + self.degraded + self.dead


# --- what a spool still holds (`lcap status`, `lcap doctor`) --------------------------------------------


@dataclass
class Backlog:
    """A spool as seen from outside its proxy and writer: whose it is and what is still waiting for the store."""

    directory: Path
    owner: int | None  # the pid of the proxy that made it (its directory's name)
    store: str | None  # the store its turns belong to
    waiting: int  # records not yet stored
    waiting_bytes: int
    oldest: float | None  # modification time of the oldest segment holding waiting records
    stored: int
    degraded: int
    dead: int


def backlog(directory: Path) -> Backlog:
    """What `directory` still holds past its writer's progress, counted from the records' length prefixes (the
    records themselves are never read: they are sealed)."""
    progress = Progress.load(directory)
    existing = segments(directory)
    start = progress.position if progress.position and progress.position[0] in existing else None
    waiting = waiting_bytes = 0
    oldest = None
    for number in existing:
        if start is not None and number < start[0]:
            continue
        offset = start[1] if start is not None and number == start[0] else 0
        count, size = _records_from(segment_path(directory, number), offset)
        if count:
            waiting += count
            waiting_bytes += size
            if oldest is None:
                try:
                    oldest = segment_path(directory, number).stat().st_mtime
                except FileNotFoundError:
                    pass
    owner = directory.name.split("-", 1)[0]
    return Backlog(
        directory,
        int(owner) if owner.isdigit() else None,
        spool_store(directory),
        waiting,
        waiting_bytes,
        oldest,
        progress.stored,
        progress.degraded,
        progress.dead,
    )


def _records_from(path: Path, offset: int) -> tuple[int, int]:
    """(complete records, their bytes) in a segment from `offset`, hopping from one length prefix to the next."""
    count = size = 0
    try:
        with open(path, "rb") as fh:
            end = os.fstat(fh.fileno()).st_size
            pos = offset
            while pos + _LENGTH.size <= end:
                fh.seek(pos)
                (length,) = _LENGTH.unpack(fh.read(_LENGTH.size))
                if pos + _LENGTH.size + length > end:
                    break  # being written
                count += 1
                size += _LENGTH.size + length
                pos += _LENGTH.size + length
    except FileNotFoundError:  # stored and deleted meanwhile
        pass
    return count, size


def backlogs(root: Path) -> list[Backlog]:
    """Every spool under `root` (`LCAP_HOME/spool`)."""
    if not root.is_dir():
        return []
    return [backlog(p) for p in sorted(root.glob("*-*")) if p.is_dir()]
