"""Secrets on the user's invocation never reach the store or an export (#54): a key in an `env NAME=VALUE` of the
agent's command, in a `--api-key VALUE` flag, in a label, and in a task field rendered into collect's command.

Real `lcap proxy` and `lcap collect` runs through the capture proxy into one DuckDB file, then `lcap export` in
every format; the store file's raw bytes and every exported file are searched for each value.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from fixtures_capture import LCAP, agent, store_text

from lcap.dataset.build.export import FORMATS
from lcap.redact import REDACTED

# Values that look like nothing: only the name they are given says they are secrets.
ENV_VALUE = "codex-env-value-0451"
FLAG_VALUE = "flag-value-0452"
LABEL_NAMED = "label-named-value-0453"
LABEL_SHAPED = "sk-proj-LabelShaped0454abcdefghijklmnop"
TASK_VALUE = "task-field-value-0455"
SECRETS = (ENV_VALUE, FLAG_VALUE, LABEL_NAMED, LABEL_SHAPED, TASK_VALUE)


def _lcap(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([LCAP, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def _all_text(path: Path) -> str:
    if path.is_dir():
        return "\n".join(_all_text(p) for p in sorted(path.rglob("*")) if p.is_file())
    return path.read_bytes().decode("latin-1")  # Parquet's pages are not compressed past recognition: checked below


def test_no_secret_of_the_invocation_is_stored_or_exported(capture_env, llm, tmp_path):
    db = Path(capture_env["LCAP_DB"])
    script = f"env CODEX_API_KEY={ENV_VALUE} {shlex.join(agent('openai_agent.py'))} chat"
    _lcap(
        capture_env,
        "proxy",
        "--upstream",
        llm.url,
        "--label",
        f"api_key={LABEL_NAMED}",
        "--label",
        f"note=pasted {LABEL_SHAPED} here",
        "--",
        "bash",
        "-c",
        script,
        "agent",
        "--api-key",
        FLAG_VALUE,
        cwd=tmp_path,
    )
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t1", "token": TASK_VALUE}) + "\n")
    template = f"env GITHUB_TOKEN={{token}} {shlex.join(agent('openai_agent.py'))} chat"
    _lcap(
        capture_env,
        "collect",
        "--tasks",
        str(tasks),
        "--upstream",
        llm.url,
        "-g",
        "1",
        "--label",
        f"secret={LABEL_NAMED}",
        "--",
        "bash",
        "-c",
        template,
        cwd=tmp_path,
    )

    stored = store_text(db) + "".join(p.read_bytes().decode("latin-1") for p in db.parent.glob(f"{db.name}.wal"))
    for secret in SECRETS:
        assert secret not in stored, f"{secret} reached the store"
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT command, labels FROM episodes ORDER BY started_at").fetchall()
    assert len(rows) == 2 and all(REDACTED in command for command, _ in rows)  # the runs were stored, redacted
    assert json.loads(rows[0][1])["api_key"] == REDACTED and "pasted" in json.loads(rows[0][1])["note"]

    for fmt in FORMATS:
        out = tmp_path / f"export-{fmt}"
        _lcap(capture_env, "export", "--db", str(db), "--format", fmt, "--out", str(out), cwd=tmp_path)
        exported = _all_text(out)
        assert "Say hello" in exported, fmt  # the conversation is there, readable as bytes
        for secret in SECRETS:
            assert secret not in exported, f"{secret} left in the {fmt} export"
