"""`lcap loop --eval-tasks` on the real vLLM CPU server promotes a round only on held-out evidence: the candidate
adapter is evaluated by name beside the current deployment before it serves a routed call, a refused one is never
deployed (not by a resume either), and the next round trains from the deployment that stayed. --promote-margin 10
forces a promotion, -10 a refusal (the rule's figures: tests/unit/test_loop_promote.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from lcap.policy import read_policy
from lcap.store import Store

from .test_train_loop import loop_command

pytestmark = pytest.mark.vllm


def _run(command: list[str], tmp_path, rounds: int, margin: float) -> subprocess.CompletedProcess:
    argv = list(command)
    argv[argv.index("--rounds") + 1] = str(rounds)
    argv[argv.index("--group-size") + 1] = "2"  # two samples per task: enough variance, half the episodes
    argv[argv.index("--eval-group-size") + 1] = "1"
    argv[argv.index("--promote-margin") + 1] = str(margin)
    env = dict(os.environ, OPENAI_API_KEY="sk-test")
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_a_refused_round_is_kept_never_deployed_and_the_next_trains_from_the_current(vllm_policy, tmp_path):
    db = tmp_path / "lcap.duckdb"
    command = loop_command(tmp_path, db)
    base = vllm_policy.served_model
    state = tmp_path / "run" / "state.json"

    first = _run(command, tmp_path, rounds=1, margin=10.0)  # any candidate is no worse by 10
    promoted = json.loads(state.read_text())["steps"]["1:deploy"]["name"]
    assert read_policy().current == promoted
    line = next(x for x in first.stdout.splitlines() if x.startswith("round 1:"))
    assert "| held-out " in line and f" vs {base} " in line and f"| promoted {promoted}" in line, first.stdout

    second = _run(command, tmp_path, rounds=2, margin=-10.0)  # no candidate gains 10: refused
    line = next(x for x in second.stdout.splitlines() if x.startswith("round 2:"))
    steps = json.loads(state.read_text())["steps"]
    verdict = steps["2:promote"]
    assert verdict["promoted"] is False and verdict["current"] == promoted and "2:deploy" not in steps
    figures = f"held-out reward {verdict['candidate_reward']:.3f} < {verdict['current_reward']:.3f} - margin -10"
    assert f"refused: {figures}; {promoted} stays" in line, second.stdout  # one line, both figures
    assert read_policy().current == promoted and verdict["candidate"] not in read_policy().loras

    third = _run(command, tmp_path, rounds=3, margin=-10.0)  # resumed: round 2 is replayed, not deployed
    assert "deploying" not in third.stdout, third.stdout
    assert read_policy().current == promoted

    store = Store(db)
    runs = dict(store.fetchall("SELECT round, output FROM train_runs"))
    init = dict(store.fetchall("SELECT round, init_from FROM train_runs"))
    assert init[1] is None and init[2] == runs[1] and init[3] == runs[1]  # round 3: from round 1, not round 2
    assert store.fetchall("SELECT name, round FROM deployments WHERE kind = 'lora'") == [(promoted, 1)]
    served = store.fetchall(
        "SELECT e.round, e.split, list(DISTINCT t.deployment) FROM turns t JOIN episodes e USING (episode_id) "
        "GROUP BY ALL ORDER BY ALL"
    )
    candidates = {n: steps[f"{n}:eval"]["name"] for n in (1, 2)}
    assert candidates[1] == promoted
    assert served[:5] == [
        (0, "eval", [base]),
        (1, "eval", [promoted]),  # the candidate by name, before it was current
        (1, "train", [base]),
        (2, "eval", [candidates[2]]),  # the refused candidate served nothing but its evaluation
        (2, "train", [promoted]),
    ]
    assert (3, "train", [promoted]) in served  # collected with the deployment that stayed
