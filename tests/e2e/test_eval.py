"""`lcap eval` on the real vLLM CPU server (the tiny model): its figures equal a hand SQL query over the episodes it
stored, and --temperature 0 reaches every call whatever the agent sends (greedy: each task's samples agree)."""

from __future__ import annotations

import json
import sys

import pytest
from stdlib_agent import chat_agent
from typer.testing import CliRunner

from lcap.cli import app
from lcap.store import Store

# An unmodified agent (an OpenAI chat call without the SDK: tests/stdlib_agent.py) that asks for temperature 1.0;
# a space ends its answer.
AGENT = chat_agent("""
import sys
print(chat([{"role": "user", "content": sys.argv[1]}], max_tokens=8, temperature=1.0, stop=[" "]))
""")

# 0/1 rewards that depend on the answer only (so greedy samples of one task agree on them too).
VERIFIER = """
def verify(ctx):
    return float(len(ctx.stdout.strip()) % 2 == 0)
"""

HAND_SQL = """
WITH t AS (
    SELECT e.task_id, count(*) AS n, count(*) FILTER (WHERE reward >= 1) AS c, avg(coalesce(reward, 0)) AS mean
    FROM episode_summary e JOIN episodes USING (episode_id)
    WHERE e.split = 'compare' AND episodes.labels->>'eval' = 'hand' GROUP BY e.task_id)
SELECT sum(n), sum(c) / sum(n), sum(mean * n) / sum(n), avg(CASE WHEN c > 0 THEN 1 ELSE 0 END), count(*) FROM t
"""


@pytest.mark.vllm
def test_eval_matches_the_store_and_sets_the_temperature(vllm_policy, openai_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "verify.py").write_text(VERIFIER)
    tasks = tmp_path / "tasks.jsonl"
    words = ["one", "two", "six", "ten", "red", "sky"]
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "q": f"Say {w} then"}) + "\n" for i, w in enumerate(words)))
    db, out = tmp_path / "lcap.duckdb", tmp_path / "eval.json"
    args = ["eval", "--tasks", str(tasks), "--db", str(db), "--samples", "3", "--temperature", "0", "--label", "hand"]
    args += ["--verifier", f"{tmp_path / 'verify.py'}:verify", "--out", str(out), "--"]
    result = CliRunner().invoke(app, [*args, sys.executable, str(tmp_path / "agent.py"), "{q}"])
    assert result.exit_code == 0, result.output
    assert "lcap eval (temperature 0)" in result.output

    [row] = json.loads(out.read_text())["rows"]
    store = Store(db)
    episodes, right, mean, pass_k, n_tasks = store.fetchall(HAND_SQL)[0]
    assert (row["episodes"], row["tasks"], row["k"]) == (episodes, n_tasks, 3) == (18, 6, 3)
    # pass@3 of 3 samples: the share of tasks with a right one
    assert (row["right"], row["mean_reward"], row["pass_at_k"]) == pytest.approx((right, mean, pass_k))
    assert row["interval"] == "wilson" and row["low"] <= row["right"] <= row["high"]

    # temperature 0 over the agent's 1.0: the samples of a task got the same tokens, and each turn says so
    answers = store.fetchall(
        "SELECT e.task_id, count(DISTINCT t.completion_token_ids) FROM turns t JOIN episode_summary e "
        "USING (episode_id) WHERE e.split = 'compare' GROUP BY e.task_id"
    )
    assert len(answers) == 6 and all(k == 1 for _, k in answers), answers
