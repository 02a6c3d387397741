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
