"""One batch of spooled records into the store, whatever the records hold.

A record must never hold up the others, and none is dropped. Each record is read, built into a `turns`
row (capture/turns/turn.py) and the batch is inserted in one statement. When DuckDB or Arrow refuses the
batch, it is split in halves until the rows it refuses are alone; such a row is stored degraded (text
that is not valid UTF-8 kept as `\\uXXXX` escapes) or, failing that, as a skeleton (the call's identity,
timing and status, without its content), with its `degraded` column saying why. Every record not stored
exactly as captured also goes to `dead_letters`, sealed as it was spooled, with the reason: lossless.

Only a store that cannot be reached (locked, disk full, broken) fails the batch as a whole
(`StoreUnavailable`): then nothing is blamed on the records, and the writer retries the same batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lcap.capture.storage.spool import Entry, unseal
from lcap.capture.turns.turn import PendingTurn, build_row, repair_text, skeleton_row
from lcap.config import LcapError
from lcap.store import Store, now

log = logging.getLogger("lcap.capture")

# Errors that say nothing about the rows: the store itself is unreachable or broken right now.
_STORE_ERRORS: tuple[type[BaseException], ...] = (
    LcapError,  # locked past the store's timeout, or cannot be opened
    duckdb.IOException,
    duckdb.FatalException,
    duckdb.InternalException,
    duckdb.TransactionException,
    duckdb.OutOfMemoryException,
    MemoryError,
    OSError,
)


class StoreUnavailable(Exception):
    """The store cannot take rows now; the batch stays in the spool and is retried."""


@dataclass
class Outcome:
    stored: int = 0  # rows stored exactly as built
    degraded: int = 0  # rows stored degraded or as skeletons (each with a dead letter)
    dead: int = 0  # records stored only as dead letters


@dataclass
class _Item:
    entry: Entry
    pending: PendingTurn
    row: dict[str, Any]
    reason: str | None = None  # set when `row` is already a skeleton: the turn could not be built


def dead_letter(directory: Path, entry: Entry, pending: PendingTurn | None, stored_as: str, reason: str) -> dict:
    return {
        "record_id": entry.record_id(directory),
        "turn_id": _text_attr(pending, "turn_id"),
        "episode_id": _text_attr(pending, "episode_id"),
        "stored_as": stored_as,
        "reason": repair_text(reason[:2000]),
        "record": entry.payload if entry.payload or not entry.size else None,  # None: set aside unread (reason)
        "created_at": now(),
    }


def store_entries(
    store: Store, directory: Path, entries: list[Entry], cipher: AESGCM, *, only_new: bool, poisoned: str | None = None
) -> Outcome:
    """Store `entries` (from spool `directory`); `only_new` skips turns already in the store (a restart may have
    stored some); `poisoned`: why the records are kept as dead letters unread (they killed earlier writers).
    Raises StoreUnavailable when the store cannot take them now."""
    batch = _Batch(store, directory, only_new)
    items: list[_Item] = []
    for entry in entries:
        if poisoned is not None:
            batch.dead(entry, None, poisoned)
            continue
        if entry.torn:
            batch.dead(entry, None, "bytes left in the spool that are not a whole record (a write cut short)")
            continue
        try:
            pending = unseal(cipher, entry.payload)
            if not isinstance(pending, PendingTurn):
                raise TypeError(f"a {type(pending).__name__}, not a turn")
        except Exception as exc:
            batch.dead(entry, None, f"unreadable spool record: {exc!r}")
            continue
        try:
            items.append(_Item(entry, pending, build_row(pending)))
        except Exception as exc:
            reason = f"could not build the row: {exc!r}"
            log.warning("lcap: turn %s is stored as a skeleton: %s", pending.turn_id, reason)
            items.append(_Item(entry, pending, skeleton_row(pending, reason), reason))
    try:
        with store.connect():  # one attach for the batch and any split of it
            batch.insert(items)
            if batch.letters:
                store.append("dead_letters", batch.letters, new_by="record_id")
    except _STORE_ERRORS as exc:
        raise StoreUnavailable(_describe(exc)) from exc
    return batch.outcome


class _Batch:
    def __init__(self, store: Store, directory: Path, only_new: bool) -> None:
        self.store, self.directory, self.only_new = store, directory, only_new
        self.outcome = Outcome()
        self.letters: list[dict[str, Any]] = []

    def dead(self, entry: Entry, pending: PendingTurn | None, reason: str) -> None:
        self.letters.append(dead_letter(self.directory, entry, pending, "none", reason))
        self.outcome.dead += 1

    def insert(self, items: list[_Item]) -> None:
        """Insert in one statement; split what is refused until the refused rows are alone."""
        if not items:
            return
        try:
            self._append([item.row for item in items])
        except _STORE_ERRORS:
            raise
        except Exception as exc:
            if len(items) == 1:
                self._degrade(items[0], exc)
            else:
                self.insert(items[: len(items) // 2])
                self.insert(items[len(items) // 2 :])
            return
        for item in items:
            if item.reason is None:
                self.outcome.stored += 1
            else:
                self.letters.append(dead_letter(self.directory, item.entry, item.pending, "skeleton", item.reason))
                self.outcome.degraded += 1

    def _degrade(self, item: _Item, exc: Exception) -> None:
        """One row the store refused: its text repaired, else a skeleton, else a dead letter alone."""
        reason = f"{item.reason}; {_describe(exc)}" if item.reason else _describe(exc)
        log.warning("lcap: turn %s is stored degraded: %s", item.pending.turn_id, reason)
        attempts: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("skeleton" if item.reason else "degraded", lambda: _repaired(item.row, reason)),
            ("skeleton", lambda: _repaired(skeleton_row(item.pending, reason), reason)),
        ]
        for stored_as, make in attempts:
            try:
                self._append([make()])
            except _STORE_ERRORS:
                raise
            except Exception as again:
                reason = f"{reason}; as {stored_as}: {_describe(again)}"
                continue
            self.letters.append(dead_letter(self.directory, item.entry, item.pending, stored_as, reason))
            self.outcome.degraded += 1
            return
        self.dead(item.entry, item.pending, reason)

    def _append(self, rows: list[dict[str, Any]]) -> None:
        self.store.append("turns", rows, new_by="turn_id" if self.only_new else None)


def _repaired(row: dict[str, Any], reason: str) -> dict[str, Any]:
    """The row with text that is not valid UTF-8 (lone surrogates) kept as `\\uXXXX` escapes."""
    fixed = {key: repair_text(value, json_text=key in _JSON_COLUMNS) for key, value in row.items()}
    fixed["degraded"] = row.get("degraded") or f"text that was not valid UTF-8 kept as \\uXXXX escapes ({reason})"
    return fixed


_JSON_COLUMNS = frozenset(("request", "response", "tool_calls"))


def _describe(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:1000]


def _text_attr(value: Any, name: str) -> str | None:
    got = getattr(value, name, None)
    return repair_text(got) if isinstance(got, str) else None
