"""A round with nothing to learn, on the real vLLM CPU server: `lcap loop` (synchronous and --async) records it
as skipped and goes on with the deployment it has, --stop-when-solved ends a loop on such rounds, and `lcap train`
alone still refuses the round (exit 2).

The verifier gives every episode of a task marked `same` one reward, so the round (or the async wave) whose tasks
are all `same` saturates whatever the tiny random model answers; the other tasks' groups always differ."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from stdlib_agent import chat_agent

from lcap.dataset.options import BuildOptions, CollectOptions
from lcap.loop.options import LoopOptions
from lcap.loop.rounds import run_loop
from lcap.loop.steps import LoopConfig
from lcap.store import Store
from lcap.train.options import TrainOptions

REPO = Path(__file__).resolve().parents[2]

# An unmodified agent (an OpenAI chat call without the SDK: tests/stdlib_agent.py); a space ends its answer, so
# completions finish with "stop".
AGENT = chat_agent("""
import sys
print(chat([{"role": "user", "content": sys.argv[1]}], max_tokens=12, temperature=1.0, stop=[" "]))
""")

# A task marked `same`: 1 for every answer (its group has nothing to learn); any other: variance in every group.
VERIFIER = """
def verify(ctx):
    if ctx.task.get("same"):
        return 1.0
    said = ctx.stdout.strip()
    return 0.8 * sum(c.islower() for c in said) / max(len(said), 1) + 0.1 * ctx.sample
"""


def _config(tmp_path: Path, same: list[bool], rounds: int, options: LoopOptions, eval_same: bool = False) -> LoopConfig:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "verify.py").write_text(VERIFIER)
    tasks = tmp_path / "tasks.jsonl"
    words = ["one", "two", "six", "ten"]
    tasks.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "q": f"Which is a number: {words[i]} list", "same": s}) + "\n"
            for i, s in enumerate(same)
        )
    )
    eval_tasks = None
    if eval_same:
        eval_tasks = tmp_path / "eval.jsonl"
        eval_tasks.write_text(json.dumps({"id": "e0", "q": "Which is a number: five text", "same": True}) + "\n")
    return LoopConfig(
        run=tmp_path / "run",
        rounds=rounds,
        tasks=tasks,
        command=[sys.executable, str(tmp_path / "agent.py"), "{q}"],
        eval_tasks=eval_tasks,
        tasks_per_round=2,  # round (wave) n: tasks 2n-2 and 2n-1, wrapping around
        collect=CollectOptions(group_size=2, concurrency=4, timeout=300, verifier=f"{tmp_path / 'verify.py'}:verify"),
        train=TrainOptions(learning_rate=1e-3, report_to="none"),
        build=BuildOptions(truncated="keep"),  # a rare answer cut by max_tokens would leave its group short
        options=options,
    )


def _steps(run: Path) -> dict:
    return json.loads((run / "state.json").read_text())["steps"]


@pytest.mark.vllm
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_saturated_round_is_skipped_and_the_loop_goes_on(vllm_policy, openai_env, tmp_path, monkeypatch, overlap):
    """Round 2's tasks are both `same`: it is recorded as skipped with its reason, the deployment of round 1 stays
    and serves round 3, which trains from round 1's adapter; `lcap train` on round 2 still exits 2."""
    monkeypatch.chdir(tmp_path)
    options = LoopOptions(overlap=True, max_staleness=0) if overlap else LoopOptions()
    config = _config(tmp_path, [False, False, True, True], 3, options)
    db = tmp_path / "lcap.duckdb"
    lines: list[str] = []
    summaries = run_loop(Store(db), config, echo=lines.append)

    assert [(s.round, s.skipped) for s in summaries] == [
        (1, None),
        (2, "every group got the same reward (2 of 2)"),
        (3, None),
    ], lines
    steps = _steps(config.run)
    first = steps["1:deploy"]["name"]
    word = "step" if overlap else "round"
    assert f"{word} 2: every group got the same reward (2 of 2): nothing to learn; {first} stays" in lines, lines
    assert "2:train" not in steps and "2:deploy" not in steps and steps["2:skipped"]["kept"] == first
    store = Store(db)
    recorded = store.fetchall("SELECT details->>'reason' FROM loop_steps WHERE round = 2 AND step = 'skipped'")
    assert recorded == [("every group got the same reward (2 of 2)",)]
    runs = store.fetchall("SELECT round, init_from, output FROM train_runs ORDER BY round")
    assert [r[0] for r in runs] == [1, 3] and runs[1][1] == runs[0][2]  # round 3 continued round 1's adapter
    served = store.fetchall(
        "SELECT DISTINCT t.deployment FROM turns t JOIN episode_summary e USING (episode_id) "
        "WHERE e.split = 'train' AND e.task_id IN ('t0', 't1') AND e.round = 3"
    )
    assert served == [(first,)]  # round 3 was collected with the deployment round 2 kept

    if not overlap:  # the same round, alone: `lcap train` refuses it
        lcap = REPO / ".venv" / "bin" / "lcap"
        train = subprocess.run(
            [
                str(lcap) if lcap.exists() else "lcap",
                "train",
                "--db",
                str(db),
                "--round",
                "2",
                "--run",
                str(config.run),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert train.returncode == 2, train.stdout[-2000:] + train.stderr[-2000:]
        assert "2 of 2 groups got the same reward" in train.stderr


@pytest.mark.vllm
def test_stop_when_solved_ends_the_loop(vllm_policy, openai_env, tmp_path, monkeypatch):
    """Every task `same`, the held-out task too: rounds 1 and 2 have nothing to learn, the held-out reward measured
    again after round 2 equals the base policy's, and --stop-when-solved 2 ends a 5-round loop there."""
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, [True, True], 5, LoopOptions(stop_when_solved=2), eval_same=True)
    lines: list[str] = []
    summaries = run_loop(Store(tmp_path / "lcap.duckdb"), config, echo=lines.append)
    assert [s.round for s in summaries] == [0, 1, 2], lines
    assert lines[-1] == (
        "stopping: 2 rounds in a row with nothing to learn, held-out reward 1.000 >= 1.000 (--stop-when-solved 2)"
    )
    steps = _steps(config.run)
    assert {"1:skipped", "2:skipped", "2:eval"} <= set(steps) and "1:eval" not in steps
    assert not any(k.startswith("3:") for k in steps)
