"""What a newcomer with their own agent hit in the first hour (issue #38): a loop that would supersede a manual
round, a placeholder API key, a crashing verifier's traceback, refused rounds and deploys, a Python-only doctor,
help that cuts flag names. Real stores, the real CLI, a stub upstream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lcap.config import LcapError
from lcap.store import Store

LCAP = str(Path(sys.executable).parent / "lcap")

AGENT = """
import sys
from openai import OpenAI
OpenAI(max_retries=0, timeout=30).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
"""


def _collect(env: dict[str, str], cwd: Path, upstream: str, *args: str) -> subprocess.CompletedProcess:
    (cwd / "agent.py").write_text(AGENT)
    tasks = cwd / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t0"}) + "\n")
    return subprocess.run(
        [LCAP, "collect", "--tasks", str(tasks), "-g", "2", "--upstream", upstream, *args]
        + ["--", sys.executable, "agent.py"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_loop_refuses_a_round_a_manual_collect_already_holds(capture_env, llm, tmp_path):
    from lcap.loop.steps import LoopConfig, check_round_is_the_loops, collect_split

    manual = _collect(capture_env, tmp_path, llm.url, "--round", "1", "--verifier", f"{sys.executable} -c 'print(1)'")
    assert manual.returncode == 0, manual.stderr
    store = Store(capture_env["LCAP_DB"])
    ((count, run_id),) = store.fetchall("SELECT count(*), any_value(collect_run) FROM episode_summary")
    assert count == 2

    config = LoopConfig(run=tmp_path / "run", rounds=2, tasks=tmp_path / "tasks.jsonl", command=["./my-agent"])
    with pytest.raises(LcapError) as refused:
        collect_split(store, config, 1, "train", config.tasks, 2)
    assert str(refused.value).startswith(
        f"round 1 (train) already has 2 episodes of another collect in this store (collect {run_id}): the loop's "
        "round 1 would supersede them"
    )
    assert str(refused.value).endswith("give the loop a store of its own (--db)")
    assert store.fetchall("SELECT count(*) FROM episodes")[0][0] == 2  # nothing ran
    check_round_is_the_loops(store, run_id, 1, "train")  # its own collect's episodes: a resume, no refusal
    check_round_is_the_loops(store, "other", 2, "train")  # another round: free
    check_round_is_the_loops(store, "other", 1, "eval")  # another split: free
