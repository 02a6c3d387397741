"""`lcap eval` tells the truth in its exit code: a deployment none of whose episodes finished (the agent cannot run)
is not a deployment that scored 0. Its figures and table still come out; the command then names it and exits 2."""

from __future__ import annotations

import json
import sys

from typer.testing import CliRunner

from lcap.cli import app
from lcap.policy import PolicyServer, write_policy
from lcap.store import Store


def test_an_eval_whose_every_episode_failed_says_so_and_exits_non_zero(tmp_path, monkeypatch, policy_stand_in):
    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    monkeypatch.chdir(tmp_path)
    write_policy(PolicyServer(policy_stand_in, None, "/m", "m", "m", "", "python", "2026-01-01"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}"}) + "\n" for i in range(3)))
    (tmp_path / "verify.py").write_text("def verify(ctx):\n    return 1.0\n")
    db, out = tmp_path / "lcap.duckdb", tmp_path / "eval.json"
    args = ["eval", "--tasks", str(tasks), "--db", str(db), "--label", "broken", "--out", str(out)]
    args += ["--verifier", f"{tmp_path / 'verify.py'}:verify", "--", sys.executable, "-c", "import no_such_module"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "lcap eval (the agent's temperature): mean reward" in result.output  # the table first
    assert result.output.strip().splitlines()[-1] == (
        "lcap: eval: no episode of m (3 failed) finished ok: see the failures above (the agent, not the deployment, "
        "is what failed; its figures count every episode as wrong)"
    )
    [row] = json.loads(out.read_text())["rows"]
    assert (row["deployment"], row["episodes"], row["right"]) == ("m", 3, 0.0)
    assert Store(db).fetchall("SELECT count(*) FROM episode_summary WHERE status = 'ok'") == [(0,)]
