"""`lcap loop` end to end on the real vLLM CPU server: two rounds, killed mid-run, resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stdlib_agent import chat_agent

from lcap.store import Store
from lcap.train.options import MISMATCH_MAX

REPO = Path(__file__).resolve().parents[2]


# An unmodified agent (an OpenAI chat call without the SDK: tests/stdlib_agent.py); a space ends its answer, so the
# tiny random model's completions finish with "stop" (not "length") and are trainable.
AGENT = chat_agent("""
import sys
print(chat([{"role": "user", "content": sys.argv[1]}], max_tokens=12, temperature=1.0, stop=[" "]))
""")


# Reward with variance on random text: the share of lowercase letters in the answer, and the episode's place in
# its group (the stop string empties about half the answers: a group of equal rewards would leave nothing to train).
VERIFIER = """
def verify(ctx):
    said = ctx.stdout.strip()
    return 0.8 * sum(c.islower() for c in said) / max(len(said), 1) + 0.1 * ctx.sample
"""


def loop_command(tmp_path: Path, db: Path) -> list[str]:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "verify.py").write_text(VERIFIER)
    (tmp_path / "tasks.jsonl").write_text(
        "".join(
            json.dumps({"id": f"t{i}", "q": f"Which is a number: code {w} tool"}) + "\n"
            for i, w in enumerate(["one", "two", "three"])
        )
    )
    (tmp_path / "eval.jsonl").write_text(json.dumps({"id": "e0", "q": "Which is a number: list five text"}) + "\n")
    return [
        str(REPO / ".venv" / "bin" / "lcap") if (REPO / ".venv" / "bin" / "lcap").exists() else "lcap",
        "loop",
        "--db",
        str(db),
        "--run",
        str(tmp_path / "run"),
        "--rounds",
        "2",
        "--tasks",
        str(tmp_path / "tasks.jsonl"),
        "--group-size",
        "3",
        "--verifier",
        f"{tmp_path / 'verify.py'}:verify",
        "--eval-tasks",
        str(tmp_path / "eval.jsonl"),
        "--eval-group-size",
        "2",
        "--concurrency",
        "3",
        "--lr",
        "1e-3",
        "--report-to",
        "none",
        "--promote-margin",  # every round deployed: these tests follow deploys (tests/e2e/test_loop_promote.py refuses)
        "10",
        "--",
        sys.executable,
        str(tmp_path / "agent.py"),
        "{q}",
    ]


@pytest.mark.vllm
def test_loop_two_rounds_killed_and_resumed(vllm_policy, tmp_path):
    db = tmp_path / "lcap.duckdb"
    command = loop_command(tmp_path, db)
    env = dict(os.environ, OPENAI_API_KEY="sk-test")
    state = tmp_path / "run" / "state.json"

    # Kill the loop (SIGKILL: no clean-up) as soon as round 1's collect is recorded.
    first = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        if state.exists() and "1:collect" in json.loads(state.read_text())["steps"]:
            break
        time.sleep(0.2)
    assert first.poll() is None, first.stdout.read().decode()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    steps = json.loads(state.read_text())["steps"]
    assert "1:collect" in steps and "2:collect" not in steps

    # The same command continues from the last completed step and finishes both rounds.
    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "round 1: train reward" in second.stdout and "round 2: train reward" in second.stdout

    steps = json.loads(state.read_text())["steps"]
    for n in (1, 2):
        assert {f"{n}:{s}" for s in ("collect", "build", "train", "deploy", "eval")} <= set(steps)
    assert "0:eval" in steps

    store = Store(db)
    counts = dict(store.fetchall("SELECT round || ':' || step, count(*) FROM loop_steps GROUP BY ALL"))
    assert counts["0:eval"] == 1 and counts["1:collect"] == 1  # finished before the kill: not run again
    assert counts["2:collect"] == 1 and counts["2:eval"] == 1
    assert store.fetchall("SELECT count(*) FROM episodes WHERE round = 1 AND split = 'train'") == [(9,)]

    runs = store.fetchall("SELECT round, init_from, output, n_samples, mismatch_kl FROM train_runs ORDER BY round")
    assert [r[0] for r in runs] == [1, 2]
    assert runs[0][1] is None and runs[1][1] == runs[0][2]  # round 2 continued round 1's adapter
    assert all(r[3] > 0 for r in runs)
    # The guard compared each round's starting policy with the deployment that served it, through the proxy.
    assert all(r[4] is not None and 0 <= r[4] < MISMATCH_MAX / 100 for r in runs), runs
    assert (tmp_path / "run" / "round-2" / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "run" / "round-2" / "data" / "samples.parquet").exists()
    assert json.loads((tmp_path / "run" / "round-2" / "config.json").read_text())["kind"] == "lora"

    from lcap.policy import read_policy

    assert read_policy().current == steps["2:deploy"]["name"]
    deployed = store.fetchall("SELECT name, round FROM deployments WHERE kind = 'lora' ORDER BY created_at")
    assert deployed[-1] == (steps["2:deploy"]["name"], 2)
    # Round 2 was collected with round 1's deployment.
    served = store.fetchall(
        "SELECT DISTINCT t.deployment FROM turns t JOIN episodes e USING (episode_id) "
        "WHERE e.round = 2 AND e.split = 'train'"
    )
    assert served == [(steps["1:deploy"]["name"],)]

    # Another adapter loaded under round 2's deployed name: round 3 is served by it, and its training stops.
    from fixtures_vllm import make_lora

    from lcap.serve.deploy import deploy_policy

    wrong = make_lora(vllm_policy.model_dir, tmp_path / "wrong" / "adapter", scale=2.0)  # far from any trained one
    deploy_policy(wrong, name=steps["2:deploy"]["name"])
    command[command.index("--rounds") + 1] = "3"
    third = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert third.returncode == 2, third.stdout[-3000:] + third.stderr[-3000:]
    assert (
        third.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"lcap: round 3: the policy being trained ({tmp_path / 'run' / 'round-2' / 'adapter'}) does not score"
        )
    )
    steps = json.loads(state.read_text())["steps"]
    assert "3:build" in steps and "3:train" not in steps


@pytest.mark.vllm
@pytest.mark.slow
def test_a_ray_loop_collects_each_round_with_the_last_deployment(vllm_policy, ray_cluster, tmp_path):
    """`lcap loop --ray`: its collects (held-out and training, every round) run on the cluster through node proxies
    the loop keeps for all of them, and each deploy reaches those proxies before the next collect."""
    db = tmp_path / "lcap.duckdb"
    command = loop_command(tmp_path, db)
    # An agent on a Ray node gets its node's environment, where the cluster has no OPENAI_API_KEY.
    (tmp_path / "agent.py").write_text('import os\nos.environ.setdefault("OPENAI_API_KEY", "sk-test")\n' + AGENT)
    end = command.index("--")
    command[end:end] = ["--ray", ray_cluster]
    env = dict(os.environ, OPENAI_API_KEY="sk-test")
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = json.loads((tmp_path / "run" / "state.json").read_text())["steps"]
    first, second = steps["1:deploy"]["name"], steps["2:deploy"]["name"]
    served = Store(db).fetchall(
        "SELECT e.round, e.split, list(DISTINCT t.deployment), count(DISTINCT e.episode_id) "
        "FROM turns t JOIN episodes e USING (episode_id) GROUP BY ALL ORDER BY ALL"
    )
    base = served[0][2]
    assert base != [first] and first != second
    assert served == [
        (0, "eval", base, 2),
        (1, "eval", [first], 2),
        (1, "train", base, 9),
        (2, "eval", [second], 2),
        (2, "train", [first], 9),  # round 2 was collected with round 1's deployment, on the kept proxies
    ]
