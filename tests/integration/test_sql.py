"""`lcap sql`: formats, read-only by default, DuckDB's message (one line) for bad SQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lcap.store import Store

LCAP = str(Path(sys.executable).parent / "lcap")


def lcap_sql(db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LCAP, "sql", "--db", str(db), *args], capture_output=True, text=True, timeout=120)


def test_sql_formats_read_only_and_bad_sql(tmp_path):
    db = tmp_path / "lcap.duckdb"
    Store(db).append("rewards", [{"episode_id": "ep", "value": 0.5, "source": "cli"}])

    rows = lcap_sql(db, "--format", "json", "SELECT episode_id, value FROM rewards")
    assert rows.returncode == 0 and [json.loads(line) for line in rows.stdout.splitlines()] == [
        {"episode_id": "ep", "value": 0.5}
    ]
    assert lcap_sql(db, "-f", "csv", "SELECT value FROM rewards").stdout.splitlines() == ["value", "0.5"]

    refused = lcap_sql(db, "DELETE FROM rewards")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1 and "read-only" in refused.stderr
    assert lcap_sql(db, "--write", "DELETE FROM rewards").returncode == 0
    assert Store(db).fetchall("SELECT count(*) FROM rewards") == [(0,)]

    bad = lcap_sql(db, "SELEC 1")
    assert bad.returncode == 2 and bad.stderr.startswith("lcap: ") and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr


def test_sql_cannot_change_the_store_or_touch_the_file_system(tmp_path):
    """Every statement sequence that tried to escape `lcap sql` (multi-statement detach/re-attach, COPY TO,
    read_text of a key, ATTACH, INSTALL/LOAD, SET back) is refused and nothing changes. With --write, writes to
    the store's own tables pass and the file system stays closed. (Store.user_sql is what `lcap sql` runs; the
    CLI's answer, one line and exit 2, is checked on a few.)"""
    import duckdb

    db = tmp_path / "lcap.duckdb"
    store = Store(db)
    store.append("rewards", [{"episode_id": "ep", "value": 0.5, "source": "cli"}])
    secret = tmp_path / "ca-key.pem"
    secret.write_text("-----BEGIN PRIVATE KEY-----\nnot-for-sql\n-----END PRIVATE KEY-----\n")
    values = {"db": db, "tmp": tmp_path, "secret": secret, "out": tmp_path / "out.csv", "other": tmp_path / "o.duckdb"}
    for statements, harm, in_write_too in _ATTACKS:
        sql = statements.format(**values)
        for write in (False, True) if in_write_too else (False,):
            try:
                with store.user_sql(write=write) as con:
                    con.execute(sql).fetchall()
            except duckdb.Error:
                pass
            else:
                raise AssertionError(f"{sql!r} (write={write}) ran: {harm}")
            assert store.fetchall("SELECT count(*) FROM rewards") == [(1,)], f"{sql!r}: {harm}"
    # nothing written (the store's lock file is lcap's: tests/unit/test_capture_secrets.py)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca-key.pem", "lcap.duckdb", "lcap.duckdb.lock"]
    for sql in ("DELETE FROM rewards", f"COPY rewards TO '{tmp_path}/out.csv'", f"SELECT * FROM read_text('{secret}')"):
        result = lcap_sql(db, sql)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, sql
        assert "not-for-sql" not in result.stdout + result.stderr
    written = lcap_sql(db, "--write", "INSERT INTO rewards VALUES ('ep2', 1.0, NULL, 'cli', now(), NULL)")
    assert written.returncode == 0, written.stderr
    assert store.fetchall("SELECT count(*) FROM rewards") == [(2,)]


# (statements, what must not happen, refused with --write too): each a way out of a read-only query.
_ATTACKS = [
    ("DELETE FROM rewards", "rows deleted", False),
    ("DETACH lcap; ATTACH '{db}' AS w; DELETE FROM w.rewards", "rows deleted after a re-attach", False),
    ("ATTACH '{db}' AS w (READ_WRITE); DROP TABLE w.rewards", "rewards dropped through a second attach", False),
    ("USE memory; DETACH lcap; ATTACH '{db}' AS lcap; DROP TABLE lcap.rewards", "rewards dropped", False),
    ("ATTACH ':memory:' AS m; USE m; DETACH lcap; ATTACH '{db}' AS s; DELETE FROM s.rewards", "rows deleted", False),
    ("COPY rewards TO '{out}'", "a file written", True),
    ("EXPORT DATABASE '{tmp}/export'", "files written", True),
    ("SELECT content FROM read_text('{secret}')", "another file read (a CA key)", True),
    ("SELECT * FROM read_csv('/etc/passwd')", "another file read", True),
    ("SELECT * FROM read_text('/etc/shadow')", "another file read", True),
    ("SELECT * FROM glob('{tmp}/*')", "a directory listed", True),
    ("ATTACH '{other}' AS o", "a database file created", True),
    ("INSTALL httpfs", "an extension installed", True),
    ("LOAD httpfs", "an extension loaded", True),
    ("SET enable_external_access = true; SELECT content FROM read_text('{secret}')", "access turned back on", True),
    ("RESET enable_external_access; SELECT content FROM read_text('{secret}')", "access reset", True),
    ("SET lock_configuration = false; SET enable_external_access = true", "the lock lifted", True),
    ("SET allowed_paths = ['{secret}']; SELECT content FROM read_text('{secret}')", "a path allowed", True),
    ("SET autoinstall_known_extensions = true; SELECT 1", "extensions allowed again", True),
]


def test_table_rounds_floats_cuts_long_text_and_shows_text_as_it_is(tmp_path):
    """The table is for reading (floats rounded, long values cut at --max-width with an ellipsis, control characters
    and rich markup shown as text); csv and json keep every value whole."""
    db = tmp_path / "lcap.duckdb"
    Store(db).append("rewards", [{"episode_id": "ep", "value": 0.123456789, "source": "cli"}])
    query = (
        "SELECT value, 1e-9 AS tiny, [0.333333333, 2.5] AS l, repeat('x', 300) AS long, "
        "'[/bold] ' || chr(27) || '[31mred' || chr(10) || 'next' AS agent FROM rewards"
    )
    table = lcap_sql(db, query)
    assert table.returncode == 0, table.stderr
    (row,) = [line for line in table.stdout.splitlines() if "0.1235" in line]
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[:3] == ["0.1235", "1.000e-09", "[0.3333, 2.5]"]
    assert cells[3] == "x" * 79 + "…"
    assert cells[4] == "[/bold] \\x1b[31mred\\nnext"
    assert "\x1b" not in table.stdout

    narrow = lcap_sql(db, "--max-width", "10", query).stdout
    assert "xxxxxxxxx…" in narrow and "x" * 10 not in narrow
    whole = lcap_sql(db, "--max-width", "0", "SELECT repeat('y', 150) AS long").stdout
    assert "y" * 150 in whole

    exact = json.loads(lcap_sql(db, "-f", "json", query).stdout)
    assert exact["value"] == 0.123456789 and exact["l"] == [0.333333333, 2.5] and exact["long"] == "x" * 300
    assert lcap_sql(db, "-f", "csv", "SELECT value FROM rewards").stdout.splitlines()[1] == "0.123456789"
