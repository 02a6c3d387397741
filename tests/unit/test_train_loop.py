"""`lcap loop`'s state and task choice per round (the loop on the vLLM CPU server: tests/e2e/test_train_loop.py)."""

from __future__ import annotations

import json

import pytest

from lcap.config import LcapError
from lcap.dataset.options import CollectOptions
from lcap.loop.steps import LoopConfig, LoopState


def test_loop_state_refuses_another_loop(tmp_path):
    config = LoopConfig(
        run=tmp_path, rounds=2, tasks=tmp_path / "t.jsonl", command=["agent"], collect=CollectOptions(group_size=4)
    )
    state = LoopState(tmp_path, config.key())
    state.finish(1, "collect", {"mean_reward": 0.5})
    assert LoopState(tmp_path, config.key()).done(1, "collect")["mean_reward"] == 0.5
    other = LoopConfig(
        run=tmp_path, rounds=3, tasks=tmp_path / "t.jsonl", command=["agent"], collect=CollectOptions(group_size=8)
    )
    with pytest.raises(LcapError, match="another agent command"):
        LoopState(tmp_path, other.key())
    more_rounds = LoopConfig(
        run=tmp_path, rounds=5, tasks=tmp_path / "t.jsonl", command=["agent"], collect=CollectOptions(group_size=4)
    )
    assert more_rounds.key() == config.key()  # extending a loop with more rounds is a resume


def test_tasks_per_round_takes_the_next_tasks_each_round(tmp_path):
    from lcap.loop.steps import round_tasks

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "q": f"question {i}"}) + "\n" for i in range(5)))
    config = LoopConfig(run=tmp_path / "run", rounds=3, tasks=tasks, command=["agent"], tasks_per_round=2)
    ids = {n: [json.loads(line)["id"] for line in round_tasks(config, n).read_text().splitlines()] for n in (1, 2, 3)}
    assert ids == {1: ["t0", "t1"], 2: ["t2", "t3"], 3: ["t4", "t0"]}  # wraps around at the file's end
    assert round_tasks(config, 3) == tmp_path / "run" / "round-3" / "tasks.jsonl"
    every = LoopConfig(run=tmp_path / "run", rounds=3, tasks=tasks, command=["agent"])
    assert round_tasks(every, 2) == tasks and every.key() != config.key()
    with pytest.raises(LcapError, match="more than the 5 tasks"):
        round_tasks(LoopConfig(run=tmp_path, rounds=1, tasks=tasks, command=["a"], tasks_per_round=6), 1)


def test_a_rounds_tasks_keep_their_templates(tmp_path):
    """A task's `template` (or `workspace`) folder is relative to the user's tasks file; the round's own file points
    at the same one."""
    from lcap.dataset.collect.episodes import load_tasks
    from lcap.dataset.collect.workspaces import source_dir as template_dir
    from lcap.loop.steps import round_tasks

    project = tmp_path / "project"
    (project / "repo").mkdir(parents=True)
    tasks = project / "tasks.jsonl"
    rows = [{"id": "t0", "q": "q", "template": "repo"}, {"id": "t1"}, {"id": "t2", "workspace": "repo"}]
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = LoopConfig(run=tmp_path / "run", rounds=1, tasks=tasks, command=["agent"], tasks_per_round=3)
    chosen = round_tasks(config, 1)
    first, second, third = load_tasks(chosen)
    root = project  # the loop's collect names the user's tasks folder as --tasks-root
    assert template_dir(first, chosen.parent, root) == project / "repo"
    assert template_dir(second, chosen.parent, root) is None
    assert template_dir(third, chosen.parent, root) == project / "repo"
