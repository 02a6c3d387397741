"""Finished turns leave the request path at once: a queue, a writer thread, batched appends.

The proxy's hooks only put a `PendingTurn` (raw bytes and timings) on a queue. The writer thread
turns it into a row (JSON parsing, SSE reassembly, redaction) and appends batches to the store,
one DuckDB open per batch. Before a batch goes to DuckDB it is written to a spool file, and the
spool is cleared once DuckDB has it: if lcap dies in between, the next proxy on the same store
replays it, so a finished turn is not lost.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import collections
import threading
import time
import uuid
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lcap.capture import dialects
from lcap.capture.redact import redact_json, redact_keys, redact_path, redact_text
from lcap.config import lcap_home
from lcap.store import Store

log = logging.getLogger("lcap.capture")


class PendingTurn:
    """What the hooks record about one call; everything expensive happens later, in the writer."""

    __slots__ = ("turn_id", "episode_id", "seq", "started_at", "t0", "t_first", "t_end", "host", "path", "dialect",
                 "transport", "upstream", "model_requested", "deployment", "request_body", "request_json",
                 "chunks", "response_body", "streamed", "encoding", "status_code", "error", "token_ids", "added",
                 "events", "done")

    def __init__(self, *, episode_id: str | None, seq: int | None, host: str, path: str, dialect: str,
                 transport: str = "http") -> None:
        self.turn_id = uuid.uuid4().hex
        self.episode_id, self.seq = episode_id, seq
        self.started_at = time.time()
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.host, self.path, self.dialect, self.transport = host, path, dialect, transport
        self.upstream: str | None = None
        self.model_requested: str | None = None
        self.deployment: str | None = None
        self.request_body: bytes = b""
        self.request_json: Any = None          # set when the hook already parsed the body
        self.chunks: list[bytes] | None = None  # SSE chunks as forwarded
        self.response_body: bytes = b""
        self.streamed = False
        self.encoding: str | None = None
        self.status_code: int | None = None
        self.error: str | None = None
        self.token_ids = False
        self.added: dialects.Added | None = None
        self.events: list[Any] | None = None    # WebSocket: decoded server events
        self.done = False


def _decode(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity" or not body:
        return body
    enc = encoding.strip().lower()
    try:
        if enc in ("gzip", "x-gzip"):
            return gzip.decompress(body)
        if enc == "deflate":
            try:
                return zlib.decompress(body)
            except zlib.error:
                return zlib.decompress(body, -zlib.MAX_WBITS)
        if enc == "br":
            import brotli

            return brotli.decompress(body)
        if enc == "zstd":
            import zstandard

            return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    except Exception as exc:  # a body lcap cannot decode is still forwarded; the turn says why
        raise ValueError(f"cannot decode {enc} body: {exc}") from exc
    return body


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


def _dumps(value: Any) -> str | None:
    return None if value is None else redact_keys(json.dumps(redact_json(value), ensure_ascii=False))


def build_row(p: PendingTurn) -> dict[str, Any]:
    """The `turns` row of a finished call."""
    error = p.error
    request = p.request_json
    if request is None and p.request_body:
        try:
            request = json.loads(p.request_body)
        except ValueError:
            request = p.request_body.decode("utf-8", "replace")
    turn = dialects.Turn()
    try:
        if p.events is not None:
            turn = dialects.assemble_events(p.dialect, p.events)
        else:
            raw = b"".join(p.chunks) if p.chunks is not None else p.response_body
            raw = _decode(raw, p.encoding)
            if raw:
                turn = dialects.assemble(p.dialect, raw, p.streamed)
                if turn.response is None and not p.streamed:
                    turn.response = raw.decode("utf-8", "replace")
    except Exception as exc:
        log.warning("lcap: could not read the answer of %s %s: %s", p.dialect, p.path, exc)
        turn.error = turn.error or f"capture: {exc}"
    if p.status_code is not None and p.status_code >= 400 and not error:
        error = turn.error or f"HTTP {p.status_code}"
    error = error or turn.error
    has_ids = bool(turn.completion_token_ids) and p.token_ids
    if isinstance(request, dict) and p.model_requested is None:
        p.model_requested = request.get("model")
    ended = p.t_end or time.perf_counter()
    return {
        "turn_id": p.turn_id,
        "episode_id": p.episode_id,
        "seq": p.seq,
        "started_at": _ts(p.started_at),
        "ended_at": _ts(p.started_at + (ended - p.t0)),
        "latency_ms": (ended - p.t0) * 1000.0,
        "ttft_ms": None if p.t_first is None else (p.t_first - p.t0) * 1000.0,
        "host": p.host,
        "path": redact_path(p.path),
        "dialect": p.dialect,
        "transport": p.transport,
        "stream": p.streamed,
        "upstream": p.upstream,
        "model_requested": p.model_requested,
        "model_served": turn.model_served,
        "deployment": p.deployment,
        "request": _dumps(request),
        "response": _dumps(turn.response),
        "status_code": p.status_code,
        "error": redact_text(error),
        "finish_reason": turn.finish_reason,
        "completion_text": redact_keys(turn.text),
        "tool_calls": _dumps(turn.tool_calls),
        "reasoning": redact_keys(turn.reasoning),
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": turn.completion_tokens,
        "prompt_token_ids": turn.prompt_token_ids if has_ids else None,
        "completion_token_ids": turn.completion_token_ids if has_ids else None,
        "completion_logprobs": turn.completion_logprobs if has_ids else None,
        "token_source": "vllm" if has_ids else None,
    }


_TIME_COLUMNS = ("started_at", "ended_at")


class TurnWriter:
    """A thread that appends finished turns to the store in batches, through a crash spool.

    `put` is a lock-free deque append that wakes nobody: the writer wakes every `interval` on its
    own (or at once for a flush or stop), so the proxy's event loop never hands the GIL to the
    writer per call. Building rows yields the GIL between turns for the same reason.
    """

    def __init__(self, store: Store, *, interval: float = 0.25, spool_dir: Path | None = None) -> None:
        self.store = store
        self.interval = interval
        self._pending: collections.deque[PendingTurn] = collections.deque()
        self._markers: collections.deque[threading.Event] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._spool_dir = spool_dir or lcap_home() / "spool"
        self._spool: Path | None = None
        self._unwritten: list[dict[str, Any]] = []
        self.written = 0
        self.failed = 0

    def start(self) -> None:
        self._spool_dir.mkdir(parents=True, exist_ok=True)
        self._spool = self._spool_dir / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self.replay_spools()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lcap-turn-writer", daemon=True)
        self._thread.start()

    def put(self, turn: PendingTurn) -> None:
        self._pending.append(turn)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until every turn put before this call is in the store (or `timeout`)."""
        if self._thread is None:
            return True
        marker = threading.Event()
        self._markers.append(marker)
        self._wake.set()
        return marker.wait(timeout)

    def stop(self) -> None:
        """Write everything put so far, then end the thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._thread = None
        if self._spool is not None and not self._unwritten:
            self._spool.unlink(missing_ok=True)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            stopping = self._stopping
            markers = []
            while self._markers:  # taken before the turns: every turn put before a flush is written
                markers.append(self._markers.popleft())
            batch = []
            while self._pending:
                batch.append(self._pending.popleft())
            if batch or self._unwritten:
                self._write(batch)
            for marker in markers:
                marker.set()
            if stopping and not self._pending:
                return  # anything DuckDB still refused stays in the spool for the next proxy

    def _write(self, batch: list[PendingTurn]) -> None:
        rows = []
        for pending in batch:
            try:
                rows.append(build_row(pending))
            except Exception:
                log.exception("lcap: dropped a turn that could not be read")
                self.failed += 1
            time.sleep(0)  # let the proxy's event loop run between turns
        self._spool_rows(rows)
        rows = self._unwritten + rows  # a batch DuckDB refused before (already in the spool) goes first
        if not rows:
            return
        try:
            self.store.append("turns", rows)
        except Exception as exc:
            self._unwritten = rows
            log.error("lcap: could not write %d turns to %s yet (kept, retried with the next batch): %s",
                      len(rows), self.store.path, exc)
            return
        self._unwritten = []
        self.written += len(rows)
        if self._spool is not None:
            self._spool.write_bytes(b"")

    def _spool_rows(self, rows: list[dict[str, Any]]) -> None:
        if self._spool is None or not rows:
            return
        store = str(self.store.path.resolve())
        with self._spool.open("a", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps({"store": store, "row": row}, default=lambda d: d.isoformat()) + "\n")

    def replay_spools(self) -> int:
        """Append the turns that a proxy which died on this store left in its spool."""
        store = str(self.store.path.resolve())
        rows: list[dict[str, Any]] = []
        done: list[Path] = []
        for path in sorted(self._spool_dir.glob("*.jsonl")):
            if path == self._spool or _pid_alive(path.name.split("-", 1)[0]):
                continue
            mine, others = [], []
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a line cut by the crash
                (mine if entry.get("store") == store else others).append(line)
            for entry in map(json.loads, mine):
                row = entry["row"]
                for col in _TIME_COLUMNS:
                    if row.get(col):
                        row[col] = datetime.fromisoformat(row[col])
                rows.append(row)
            if others:
                continue  # another store's turns: its own proxy replays them
            done.append(path)
        if rows:
            known = {r[0] for r in self.store.fetchall(
                "SELECT turn_id FROM turns WHERE turn_id IN (SELECT unnest(?))", [[r["turn_id"] for r in rows]])}
            fresh = [r for r in rows if r["turn_id"] not in known]
            self.store.append("turns", fresh)
            if fresh:
                log.warning("lcap: recovered %d turns from a spool left by a proxy that died", len(fresh))
        for path in done:
            path.unlink(missing_ok=True)
        return len(rows)


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
