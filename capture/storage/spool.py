"""The turn spool: every finished call is on disk the moment it finishes, before DuckDB sees it.

A spool is a directory per proxy (`LCAP_HOME/spool/PID-XXXXXXXX/`, mode 0700) holding numbered
segments of length-prefixed records, a `store` file naming the DuckDB file the turns belong to, and a
`progress` file where the writer keeps how far it has stored them. The proxy appends one record per
finished call with one `write`; the writer process reads the segments in order and deletes each once
its turns are in the store. A record written survives anything that happens to lcap afterwards (kill -9
included): the writer process, its restart, or the next proxy on the same store still gets it into DuckDB.

A write the disk refuses (full, over quota, failing) never fails the call: the part written is cut off the
segment, and the record waits in memory (`--max-spool-backlog` bytes, in order) until a thread with backoff
writes it. Past that bound a record is lost, counted and logged. A reader that leaves a segment with bytes it
could not read as records hands them on as one torn entry (a dead letter), never skipping them.

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
import shutil
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lcap.config import LcapError

log = logging.getLogger("lcap.capture")

SEGMENT_BYTES = 32 << 20
_LENGTH = struct.Struct("<I")
_SUFFIX = ".turns"
_ENCRYPTED = b"E"  # a record's first byte; a pickle (spools of lcap before encryption) starts with 0x80
_NONCE = 12
KEY_NAME = "key"
_RETRY_DELAY = (0.05, 2.0)  # backoff between tries to write held records to a disk that refused them
_LOSS_LOG_SECONDS = 10.0  # records lost past the backlog's bound are logged at most this often (with a count)
SPOOL_BACKLOG_BYTES = 256 << 20  # default bound of the turns held in memory while the spool's disk refuses them
PROGRESS_BYTES = 4096  # the progress file's fixed size: rewritten in place, it needs no new space on a full disk


def segment_path(directory: Path, number: int) -> Path:
    return directory / f"{number:08d}{_SUFFIX}"


def segments(directory: Path) -> list[int]:
    return sorted(int(p.name[: -len(_SUFFIX)]) for p in directory.glob(f"*{_SUFFIX}"))


def _frames(fh: BinaryIO, pos: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each whole record of an open segment from `pos`, hopping from one length prefix to the
    next; the file is left at the record's payload. Stops before a record being written, or cut by a crash."""
    end = os.fstat(fh.fileno()).st_size
    while pos + _LENGTH.size <= end:
        fh.seek(pos)
        (length,) = _LENGTH.unpack(fh.read(_LENGTH.size))
        if pos + _LENGTH.size + length > end:
            return
        yield pos, length
        pos += _LENGTH.size + length


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


def _encrypt(cipher: AESGCM, plain: bytes) -> bytes:
    nonce = os.urandom(_NONCE)
    return _ENCRYPTED + nonce + cipher.encrypt(nonce, plain, None)


def _decrypt(cipher: AESGCM, payload: bytes) -> bytes:
    return cipher.decrypt(payload[1 : 1 + _NONCE], payload[1 + _NONCE :], None)


def seal(cipher: AESGCM, record: Any) -> bytes:
    return _encrypt(cipher, pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))


def unseal(cipher: AESGCM, payload: bytes) -> Any:
    """The record a spool payload holds (raises on a damaged one)."""
    if payload[:1] == _ENCRYPTED:
        payload = _decrypt(cipher, payload)
    return pickle.loads(payload)


def reseal(source: AESGCM, target: AESGCM, payload: bytes) -> bytes:
    """A sealed record sealed again under another key (a Ray node's records, into the driver's spool). A record
    `source` cannot open is returned as it is: the writer keeps it as a dead letter, unreadable, but kept."""
    if payload[:1] != _ENCRYPTED:
        return payload
    try:
        plain = _decrypt(source, payload)
    except Exception:
        return payload
    return _encrypt(target, plain)


class SpoolAppender:
    """The proxy's side: append records, starting a new segment past `SEGMENT_BYTES`. Thread-safe.

    `store_path` names the store its writer fills (None: a Ray node's spool, which the driver empties);
    `cipher` seals the records (default: the key beside the spools). A record the disk refuses waits in
    memory, up to `max_backlog` bytes of them, and a thread writes them in order once the disk takes them."""

    def __init__(
        self,
        directory: Path,
        store_path: Path | None,
        cipher: AESGCM | None = None,
        *,
        max_backlog: int = SPOOL_BACKLOG_BYTES,
    ) -> None:
        self.cipher = cipher or spool_key(directory.parent)
        private_dir(directory)
        if store_path is not None:
            fd = os.open(directory / "store", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, str(store_path.resolve()).encode())
            finally:
                os.close(fd)
        self.directory = directory
        self.max_backlog = max_backlog
        self.appended = 0  # records on disk
        self.lost = 0  # records never written: past the backlog's bound, or still held at `close`
        self.refused = 0  # writes the disk refused
        self._lock = threading.Condition()
        self._held: deque[bytes] = deque()
        self._held_bytes = 0
        self._retrying = False
        self._closed = False
        self._torn = False  # a refused write could not be cut back: the next record starts a new segment
        self._loss_logged = 0.0
        self._segment = 0
        self._size = 0
        self._fd = self._open(1)

    def _open(self, number: int) -> int:
        fd = os.open(segment_path(self.directory, number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segment, self._size = number, os.fstat(fd).st_size
        return fd

    def append(self, record: Any) -> None:
        self.append_payload(seal(self.cipher, record))

    def append_payload(self, data: bytes) -> None:
        """Append one sealed record (`append` seals it; tests write damaged ones with this). Never raises for the
        disk: a record it refuses is held and written later, or counted lost."""
        framed = _LENGTH.pack(len(data)) + data
        with self._lock:
            if self._closed:
                self._lose(1, "the spool is closed")
                return
            if not self._held and self._write(framed):
                return
            if self._held_bytes + len(framed) > self.max_backlog:
                self._lose(1, f"{self._held_bytes} bytes of turns already wait in memory for the disk")
                return
            self._held.append(framed)
            self._held_bytes += len(framed)
            if not self._retrying:
                self._retrying = True
                threading.Thread(target=self._retry, name="lcap-spool-retry", daemon=True).start()

    def _write(self, framed: bytes) -> bool:
        """Write one framed record whole, or nothing of it (False: the disk refused it). Under the lock."""
        try:
            if self._torn or (self._size and self._size + len(framed) > SEGMENT_BYTES):
                fd = self._open_next()
                os.close(self._fd)
                self._fd, self._torn = fd, False
            view = memoryview(framed)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self.refused += 1
            if self.refused == 1 or not self._held:
                log.error(
                    "lcap: cannot write to the spool %s (%s): turns wait in memory until it can (up to %d MiB)",
                    self.directory,
                    exc,
                    self.max_backlog >> 20,
                )
            self._cut_back()
            return False
        self._size += len(framed)
        self.appended += 1
        return True

    def _open_next(self) -> int:
        number = self._segment + 1
        fd = os.open(segment_path(self.directory, number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segment, self._size = number, 0
        return fd

    def _cut_back(self) -> None:
        """Remove the part of a refused record that reached the segment: what follows must start at a record."""
        try:
            if os.fstat(self._fd).st_size != self._size:
                os.ftruncate(self._fd, self._size)
        except OSError as exc:
            log.error(
                "lcap: cannot cut a torn record off %s (%s): the next record starts a new segment", self.directory, exc
            )
            self._torn = True

    def _retry(self) -> None:
        delay = _RETRY_DELAY[0]
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closed, delay)
                while self._held and self._write(self._held[0]):
                    self._held_bytes -= len(self._held.popleft())
                if not self._held or self._closed:
                    if not self._held:
                        log.warning(
                            "lcap: the spool %s takes records again: the turns held in memory are in it", self.directory
                        )
                    self._retrying = False
                    self._lock.notify_all()
                    return
            delay = min(delay * 2, _RETRY_DELAY[1])

    def _lose(self, count: int, why: str) -> None:
        self.lost += count
        now = time.monotonic()
        if now - self._loss_logged > _LOSS_LOG_SECONDS or self._closed:
            self._loss_logged = now
            log.error("lcap: %d turn(s) lost, never spooled (%s): %d lost so far", count, why, self.lost)

    @property
    def held(self) -> int:
        """Records waiting in memory for the disk."""
        with self._lock:
            return len(self._held)

    def wait_written(self, timeout: float | None) -> bool:
        """Block until no record waits in memory (False after `timeout`)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._held, timeout)

    def position(self) -> tuple[int, int]:
        """(segment, bytes) written so far: a reader at or past it has seen every record appended."""
        with self._lock:
            return self._segment, self._size

    def close(self) -> None:
        """Close the segment; records still held in memory (the disk never took them back) are lost, and said so."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            if self._held:
                count = len(self._held)
                self._held.clear()
                self._held_bytes = 0
                self._lose(count, f"the spool's disk did not take them before the end ({self.directory})")
            os.close(self._fd)


@dataclass
class Entry:
    """One record as read from the spool: where it is (its id in dead_letters), its sealed bytes (empty until read
    when the reader was asked for places only) and their length. A torn entry holds bytes left in a segment that
    do not make a record (a write cut by a crash): never a turn, kept as a dead letter."""

    segment: int
    offset: int
    payload: bytes
    size: int = -1
    torn: bool = False

    def __post_init__(self) -> None:
        if self.size < 0:
            self.size = len(self.payload)

    @property
    def end(self) -> int:
        """The offset right after the record (its length prefix included)."""
        return self.offset + self.size + (0 if self.torn else _LENGTH.size)

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

    def read(self, limit: int = 1 << 30, max_bytes: int = 1 << 62, *, payloads: bool = True) -> list[Entry]:
        """Up to `limit` records (and about `max_bytes`); the rest stays for the next read. Without `payloads`,
        only where each record is and its size (`payload` reads it)."""
        entries: list[Entry] = []
        size = 0
        while len(entries) < limit and size < max_bytes:
            size += self._read_segment(entries, limit, max_bytes - size, payloads)
            if len(entries) >= limit or size >= max_bytes:
                break
            if not segment_path(self.directory, self.segment + 1).exists():
                break
            # The appender opens the next segment only after its last write to this one: read that too.
            size += self._read_segment(entries, limit, max_bytes - size, payloads)
            if len(entries) >= limit or size >= max_bytes:
                break
            size += self._torn_tail(entries, payloads)
            self.finished.append(self.segment)
            self.segment, self.offset = self.segment + 1, 0
        return entries

    def read_end(self, *, payloads: bool = True) -> list[Entry]:
        """Once nothing more is appended (the appender closed, or its process died): what `read` left at the end of
        the last segment, as one torn entry (none when the spool ends on a whole record)."""
        entries: list[Entry] = []
        self._read_segment(entries, 1 << 30, 1 << 62, payloads)
        if not entries:
            self._torn_tail(entries, payloads)
        return entries

    def payload(self, entry: Entry) -> bytes:
        """The bytes of an entry read without them."""
        if entry.payload or not entry.size:
            return entry.payload
        with open(segment_path(self.directory, entry.segment), "rb") as fh:
            fh.seek(entry.offset + (0 if entry.torn else _LENGTH.size))
            return fh.read(entry.size)

    def _read_segment(self, entries: list[Entry], limit: int, max_bytes: int, payloads: bool) -> int:
        try:
            fh = open(segment_path(self.directory, self.segment), "rb")
        except FileNotFoundError:
            return 0
        pos = self.offset
        with fh:
            for at, length in _frames(fh, self.offset):
                if len(entries) >= limit or pos - self.offset >= max_bytes:
                    break
                payload = fh.read(length) if payloads else b""
                entries.append(Entry(self.segment, at, payload, length))
                pos = at + _LENGTH.size + length
        read, self.offset = pos - self.offset, pos
        return read

    def _torn_tail(self, entries: list[Entry], payloads: bool) -> int:
        """Bytes past the last whole record of the current segment, which no record will complete: one torn entry."""
        path = segment_path(self.directory, self.segment)
        try:
            left = path.stat().st_size - self.offset
        except FileNotFoundError:
            return 0
        if left <= 0:
            return 0
        log.error(
            "lcap: %d bytes at %s offset %d are not a whole record: kept as a dead letter", left, path, self.offset
        )
        payload = b""
        if payloads:
            with open(path, "rb") as fh:
                fh.seek(self.offset)
                payload = fh.read(left)
        entries.append(Entry(self.segment, self.offset, payload, left, torn=True))
        self.offset += left
        return left

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
            data = _read_progress(directory / "progress")
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
        # One page rewritten in place and synced: a kill cannot tear it, and a full disk cannot refuse it once the
        # file exists (the writer notes an attempt here before it makes it).
        text = json.dumps(asdict(self)).encode()
        fd = os.open(directory / "progress", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, text.ljust(max(PROGRESS_BYTES, len(text))), 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    @property
    def handled(self) -> int:
        return self.stored + self.degraded + self.dead


def _read_progress(path: Path) -> Any:
    """The progress file's JSON; read again once if it was being rewritten just then."""
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except ValueError:
        return json.loads(path.read_text(encoding="utf-8"))


# --- the spool's disk ------------------------------------------------------------------------------------------


SPOOL_MIN_FREE_BYTES = 1 << 30  # below this much free space, or
SPOOL_MIN_FREE_FRACTION = 0.05  # this part of the disk, the spool's disk is nearly full (`lcap doctor` warns)


def spool_disk(root: Path) -> tuple[int, int, bool]:
    """(free bytes, total bytes, nearly full) of the file system holding the spools under `root` (or its parent
    while it does not exist yet)."""
    path = root
    while not path.exists() and path != path.parent:
        path = path.parent
    usage = shutil.disk_usage(path)
    nearly_full = usage.free < SPOOL_MIN_FREE_BYTES or usage.free < usage.total * SPOOL_MIN_FREE_FRACTION
    return usage.free, usage.total, nearly_full


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
    """(complete records, their bytes) in a segment from `offset`."""
    count = size = 0
    try:
        with open(path, "rb") as fh:
            for _at, length in _frames(fh, offset):
                count += 1
                size += _LENGTH.size + length
    except FileNotFoundError:  # stored and deleted meanwhile
        pass
    return count, size


def backlogs(root: Path) -> list[Backlog]:
    """Every spool under `root` (`LCAP_HOME/spool`)."""
    if not root.is_dir():
        return []
    return [backlog(p) for p in sorted(root.glob("*-*")) if p.is_dir()]
