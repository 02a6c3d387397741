"""Capture you can trust, the storage side: no turn is lost or stuck, whatever it holds and whatever happens to
the writer process; the proxy says at exit what became of its turns.

Real parts throughout: `lcap proxy` with its writer process, the spool on disk, DuckDB files; the agents write
their requests byte by byte (tests/agents_capture/raw_agent.py) so that odd bytes reach the proxy as sent.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct

import duckdb
from fixtures_capture import agent, open_files, pending_turn, run_lcap, turns

from lcap.capture.storage.spool import seal, segment_path
from lcap.capture.storage.writer import TurnWriter
from lcap.store import Store


def _rows(db, sql: str) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_odd_strings_are_stored_degraded_and_never_block_later_turns(capture_env, llm):
    """A lone surrogate escape in a body and a raw 0xFF byte in a path once stopped every later turn (the batch
    was retried forever); now each is stored, flagged, and the rest lands, in this proxy and the next."""
    db = capture_env["LCAP_DB"]
    result = run_lcap(
        ["proxy", "--upstream", llm.url, "--", *agent("raw_agent.py"), "surrogate", "ff_path", "normal", "normal"],
        capture_env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["HTTP/1.1 200 OK"] * 4  # the agent's traffic was never touched
    rows = turns(db)
    assert len(rows) == 4
    odd = next(r for r in rows if r["degraded"])
    assert odd["request"]["messages"][0]["content"] == "\\ud83d"  # the escape, as text: readable, nothing lost
    assert odd["completion_text"] and odd["error"] is None and "UnicodeEncodeError" in odd["degraded"]
    assert sorted(r["path"] for r in rows)[-1] == "/v1/chat/completions?x=%FF"  # the raw byte, percent-encoded
    ((turn_id, stored_as, reason, record),) = _rows(db, "SELECT turn_id, stored_as, reason, record FROM dead_letters")
    assert turn_id == odd["turn_id"] and stored_as == "degraded" and "surrogates not allowed" in reason
    assert b"\\ud83d" not in record and b"content" not in record  # sealed as spooled: no plain text
    assert f"4 of 4 turns stored in {db} (1 degraded, 0 dead letters)" in result.stderr

    again = run_lcap(["proxy", "--upstream", llm.url, "--", *agent("raw_agent.py"), "surrogate", "normal"], capture_env)
    assert again.returncode == 0, again.stderr
    assert len(turns(db)) == 6


class _ExitsOnLoad:
    """Unpickled, it ends the process at once: a record that kills the writer (as an OOM kill would)."""

    def __reduce__(self):
        return (os._exit, (99,))


def test_refused_rows_are_split_out_of_their_batch(tmp_path, capture_home):
    """One batch holds rows DuckDB or Arrow refuse (a lone surrogate, a count past INTEGER, a count that is text)
    and a damaged record: each is stored degraded, as a skeleton or as a dead letter; the others as they were."""
    db = tmp_path / "db.duckdb"
    writer = TurnWriter(Store(db), interval=0.05, spool_root=tmp_path / "spool")
    writer.start()
    assert writer._spool is not None
    good = [pending_turn(f"good-{i}") for i in range(5)]
    writer.put(good[0])
    writer.put(pending_turn("surrogate", "half an emoji \ud83d"))
    writer.put(good[1])
    writer.put(pending_turn("too-big", usage={"prompt_tokens": 2**40, "completion_tokens": 1}))
    writer.put(good[2])
    writer.put(pending_turn("text-count", usage={"prompt_tokens": "many", "completion_tokens": 1}))
    writer.put(good[3])
    writer._spool.append_payload(b"E" + os.urandom(64))  # a record whose seal does not open
    writer.put(good[4])
    report = writer.finish(timeout=60)
    assert report is not None and (report.spooled, report.stored, report.degraded, report.dead) == (9, 5, 3, 1)
    assert report.unstored == 0
    rows = {r["episode_id"]: r for r in turns(db)}
    for pending in good:
        assert rows[pending.episode_id]["completion_text"] == "hi" and rows[pending.episode_id]["degraded"] is None
    assert rows["surrogate"]["completion_text"] == "half an emoji \\ud83d"
    for skeleton in ("too-big", "text-count"):
        row = rows[skeleton]
        assert row["degraded"].startswith("stored without content") and row["error"].startswith("capture:")
        assert row["request"] is None and row["path"] == "/v1/chat/completions" and row["status_code"] == 200
    letters = _rows(db, "SELECT episode_id, stored_as FROM dead_letters ORDER BY record_id")
    assert sorted(letters, key=str) == sorted(
        [("surrogate", "degraded"), ("too-big", "skeleton"), ("text-count", "skeleton"), (None, "none")], key=str
    )


def test_a_killed_writer_is_restarted_and_stores_each_turn_once(tmp_path, capture_home):
    """kill -9 of the writer: the proxy starts another on the same spool. Even when the dead writer had stored
    turns without noting it (its progress file set back here), each turn is stored once."""
    db, root = tmp_path / "db.duckdb", tmp_path / "spool"
    writer = TurnWriter(Store(db), interval=0.05, spool_root=root)
    writer.start()
    assert writer._spool is not None and writer._proc is not None
    for i in range(5):
        writer.put(pending_turn(f"before-{i}"))
    assert writer.flush(timeout=30)
    progress, end = writer._spool.directory / "progress", list(writer._spool.position())
    fds = open_files("pipe")
    assert fds >= 2  # the writer's stdin and stdout
    os.kill(writer._proc.pid, signal.SIGKILL)
    # As if it died after storing its batch but before noting it: only the attempt is noted.
    progress.write_text(json.dumps({"position": None, "attempt_at": [1, 0], "attempt_end": end, "attempts": 1}))
    for i in range(5):
        writer.put(pending_turn(f"after-{i}"))
    assert writer.flush(timeout=60)
    assert open_files("pipe") == fds  # the dead writer's pipes were closed, the new one's opened
    report = writer.finish(timeout=60)
    assert report is not None and report.restarts == 1 and report.unstored == 0
    episodes = sorted(r["episode_id"] for r in turns(db))
    assert episodes == sorted([f"before-{i}" for i in range(5)] + [f"after-{i}" for i in range(5)])


def test_a_record_that_kills_the_writer_becomes_a_dead_letter(tmp_path, capture_home):
    """A record the writer dies on (every time it reads it) is taken alone, then kept unread as a dead letter:
    the writer is restarted and the turns around it are stored."""
    db, root = tmp_path / "db.duckdb", tmp_path / "spool"
    writer = TurnWriter(Store(db), interval=0.5, spool_root=root)
    writer.start()
    assert writer._spool is not None
    writer.put(pending_turn("first"))
    assert writer.flush(timeout=30)
    assert writer._proc is not None
    os.kill(writer._proc.pid, signal.SIGSTOP)  # both records land before its next read: one batch, whatever the load
    try:
        writer._spool.append_payload(seal(writer._spool.cipher, _ExitsOnLoad()))
        writer.put(pending_turn("last"))
    finally:
        os.kill(writer._proc.pid, signal.SIGCONT)
    assert writer.flush(timeout=60)
    report = writer.finish(timeout=60)
    # Died on the batch, then twice on the record alone; the fourth writer keeps it unread.
    assert report is not None and report.restarts == 3 and (report.stored, report.dead, report.unstored) == (2, 1, 0)
    assert sorted(r["episode_id"] for r in turns(db)) == ["first", "last"]
    ((reason, record),) = _rows(db, "SELECT reason, record FROM dead_letters WHERE stored_as = 'none'")
    assert reason == "the writer process died on this record (2 times)" and pickle.dumps(_ExitsOnLoad()) not in record


def test_unstored_turns_are_a_warning_and_an_episode_flag(capture_env, llm):
    """When the writer cannot store the turns by the end (here: killed as soon as it starts, again and again),
    lcap says so on stderr and flags the episode; the turns stay in the spool for the next proxy on the store."""
    db = capture_env["LCAP_DB"]
    result = run_lcap(
        ["proxy", "--upstream", llm.url, "--", *agent("raw_agent.py"), "kill_writers", "60", "normal", "normal"],
        capture_env,
    )
    assert result.returncode == 0, result.stderr
    assert "warning: 2 not stored yet, left in" in result.stderr and "the writer process was restarted" in result.stderr
    (flag,) = _rows(db, "SELECT details FROM episode_flags WHERE flag = 'turns_unstored'")
    assert json.loads(flag[0])["unstored"] == 2
    assert _rows(db, "SELECT count(*) FROM turns") == [(0,)]
    # The killer ended with that proxy; the next proxy on this store replays the spool.
    later = run_lcap(["proxy", "--", "true"], capture_env)
    assert later.returncode == 0, later.stderr
    assert _rows(db, "SELECT count(*) FROM turns") == [(2,)] and "recovered 2 turns" in later.stderr


def test_bytes_that_are_not_a_whole_record_are_a_dead_letter_never_skipped(tmp_path, capture_home):
    """Part of a record left in a segment (a write cut by a crash), then a new segment, and part of another at the
    spool's very end: each torn part is kept as a dead letter, the whole records around them are stored, and the
    spool is removed only once nothing in it is left unhandled."""
    db, root = tmp_path / "db.duckdb", tmp_path / "spool"
    writer = TurnWriter(Store(db), interval=0.05, spool_root=root)
    writer.start()
    spool = writer._spool
    assert spool is not None
    writer.put(pending_turn("before"))
    torn = struct.pack("<I", 5000) + b"E" + os.urandom(100)  # says 5000 bytes follow; 101 do
    with open(segment_path(spool.directory, 1), "ab") as fh:
        fh.write(torn)
    spool._torn = True  # as after a write that could not be cut back: the next record starts a new segment
    writer.put(pending_turn("after"))
    with open(segment_path(spool.directory, 2), "ab") as fh:
        fh.write(torn)
    report = writer.finish(timeout=60)
    assert report is not None and (report.stored, report.dead, report.unstored) == (2, 2, 0), report
    assert sorted(r["episode_id"] for r in turns(db)) == ["after", "before"]
    letters = _rows(db, "SELECT reason, record FROM dead_letters ORDER BY record_id")
    assert [reason for reason, _ in letters] == [
        "bytes left in the spool that are not a whole record (a write cut short)"
    ] * 2
    assert all(record == torn for _, record in letters)
    assert not spool.directory.exists()
