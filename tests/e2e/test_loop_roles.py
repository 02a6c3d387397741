"""`lcap loop --per-role` on the real vLLM CPU server (the tiny model) with real TRL training: an agent whose every
episode makes one planner call and one solver call (`X-Lcap-Role`) gets, after one round, an adapter per role in its
own run folder. With --eval-tasks the round's adapters are one candidate of the promotion gate: evaluated on the
held-out tasks with each role's calls pinned to its adapter before any routed call sees them, then made both roles'
deployments by one deploy. The verifier rewards the sample index, so every policy's held-out reward is the same:
margin 0 promotes; the same loop resumed for a second round with --promote-margin -1 (a gain of 1 demanded) must
refuse, and the refused adapters serve nothing but their own evaluation. The step bookkeeping and the role listing
alone: tests/unit/test_loop_roles.py; the gate's decisions: tests/unit/test_loop_promote.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stdlib_agent import chat_agent

from lcap.loop.status import loop as loop_status
from lcap.policy import read_policy
from lcap.status import View
from lcap.store import Store

REPO = Path(__file__).resolve().parents[2]

# An unmodified agent of two roles (OpenAI chat calls without the SDK: tests/stdlib_agent.py): the planner's call,
# then the solver's on what the planner said.
AGENT = chat_agent("""
import sys
said = sys.argv[1]
for role in ("planner", "solver"):
    said = chat([{"role": "user", "content": f"{role}: {said}"}], max_tokens=8, temperature=1.0, stop=[" "],
                headers={"X-Lcap-Role": role})
print(said)
""")

# A reward per sample index: every group of two has two rewards, so each role has something to learn.
VERIFIER = """
def verify(ctx):
    return float(ctx.sample)
"""


@pytest.mark.vllm
def test_every_role_trains_its_own_adapter_and_one_deploy_serves_them(vllm_policy, tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "verify.py").write_text(VERIFIER)
    tasks, held_out = tmp_path / "tasks.jsonl", tmp_path / "eval.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "q": f"Which is a number: {w}"}) + "\n" for i, w in enumerate(["one", "six"])
        )
    )
    held_out.write_text(json.dumps({"id": "e0", "q": "Which is a number: ten"}) + "\n")
    db, run = tmp_path / "lcap.duckdb", tmp_path / "run"
    lcap = REPO / ".venv" / "bin" / "lcap"
    command = [str(lcap) if lcap.exists() else "lcap", "loop", "--per-role", "--db", str(db), "--run", str(run)]
    command += ["--rounds", "1", "--tasks", str(tasks), "--group-size", "2", "--concurrency", "4"]
    command += ["--eval-tasks", str(held_out), "--verifier", f"{tmp_path / 'verify.py'}:verify"]
    command += ["--truncated", "keep", "--min-groups", "1", "--lr", "1e-3", "--report-to", "none"]
    command += ["--", sys.executable, str(tmp_path / "agent.py"), "{q}"]
    env = dict(os.environ, OPENAI_API_KEY="sk-test")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()

    steps = json.loads((run / "state.json").read_text())["steps"]
    deployed = steps["1:deploy"]["roles"]
    assert set(deployed) == {"planner", "solver"} and steps["1:roles"]["roles"] == ["planner", "solver"]
    for role, info in deployed.items():
        adapter = run / "round-1" / f"role-{role}" / "adapter"
        assert info["path"] == str(adapter) and (adapter / "adapter_config.json").is_file()
        assert info["name"].startswith(f"policy-{role}-r1-")
        assert {f"1:build:{role}", f"1:train:{role}"} <= set(steps)
        # one line per role, naming its adapter
        assert len([line for line in lines if line.startswith(f"round 1 role {role}: ")]) == 1, lines
        assert any(line.endswith(f"| {adapter}") for line in lines), lines
    assert not any(line.startswith("note:") for line in lines), lines  # gated: no "deploys before it evaluates"
    assert steps["1:promote"]["promoted"] is True and steps["1:promote"]["roles"] == deployed
    round_line = next(line for line in lines if line.startswith("round 1: train reward"))
    promoted = f"promoted planner {deployed['planner']['name']}, solver {deployed['solver']['name']}"
    assert f"| held-out {steps['1:eval']['mean_reward']:.3f} vs " in round_line and promoted in round_line

    record = read_policy()
    assert record is not None and record.roles == {role: info["name"] for role, info in deployed.items()}
    assert record.current == vllm_policy.served_model  # the default role made no call: its deployment is untouched
    assert all(record.loras[info["name"]] == info["path"] for info in deployed.values())
    store = Store(db)
    runs = store.fetchall("SELECT config->>'role', init_from, output FROM train_runs ORDER BY 1")
    assert runs == [(role, None, deployed[role]["path"]) for role in ("planner", "solver")]  # both from the base
    assert store.fetchall("SELECT role, name, round FROM deployments WHERE kind = 'lora' ORDER BY 1") == [
        (role, deployed[role]["name"], 1) for role in ("planner", "solver")
    ]

    # Round 2, the same loop resumed, demanding a gain of 1: refused. Its held-out calls were served by its
    # candidates (pinned), which then left the record; every role keeps round 1's adapter.
    margin = command.index("--eval-tasks")
    again = [*command[:margin], "--promote-margin", "-1", *command[margin:]]
    again[again.index("--rounds") + 1] = "2"
    done = subprocess.run(again, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = json.loads((run / "state.json").read_text())["steps"]
    verdict = steps["2:promote"]
    assert verdict["promoted"] is False and "2:deploy" not in steps and set(verdict["roles"]) == {"planner", "solver"}
    line = next(line for line in done.stdout.splitlines() if line.startswith("round 2: train reward"))
    assert f"refused: {verdict['reason']}; {verdict['current']} stays" in line, done.stdout
    assert verdict["reason"].endswith("- margin -1") and verdict["current"] == (
        f"{vllm_policy.served_model}; planner={deployed['planner']['name']}, solver={deployed['solver']['name']}"
    )
    record = read_policy()
    assert record.roles == {role: info["name"] for role, info in deployed.items()}
    assert not any(info["name"] in record.loras for info in verdict["roles"].values())
    served = store.fetchall(
        "SELECT e.round, e.split, t.role, t.deployment FROM turns t JOIN episode_summary e USING (episode_id) "
        "WHERE e.round >= 1 GROUP BY ALL ORDER BY ALL"
    )
    candidates = {role: info["name"] for role, info in verdict["roles"].items()}
    assert served == [
        *[(1, "eval", role, deployed[role]["name"]) for role in ("planner", "solver")],  # round 1's candidates
        *[(1, "train", role, vllm_policy.served_model) for role in ("planner", "solver")],
        *[(2, "eval", role, candidates[role]) for role in ("planner", "solver")],  # pinned, never deployed
        *[(2, "train", role, deployed[role]["name"]) for role in ("planner", "solver")],
    ]
    assert store.fetchall("SELECT count(*) FROM deployments WHERE round = 2") == [(0,)]
    status = loop_status(View(db, time.time()))  # `lcap status`: the refused round, as a single adapter's
    assert status.rows[0][1] == f"refused: {verdict['reason']}"
