"""`lcap demo --reward judge`: its wiring (the judge rewards the training episodes, the exact verifier the held-out
ones), its refusals, and the judge's agreement with the exact verifier read from the store. The run itself is
measured, not tested: docs/benchmarks.md."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lcap.cli import app
from lcap.config import LcapError
from lcap.dataset.judge.prompt import Rubric, Sample, pointwise_prompt
from lcap.loop import steps
from lcap.loop.demo import judged, runner
from lcap.loop.demo.number import write_jsonl
from lcap.loop.options import LoopOptions
from lcap.store import Store


def demo_config(tmp_path: Path, reward: str):
    tmp_path.mkdir()
    kind = runner.demo_task("calculator")
    settings = kind.settings()
    train, held = kind.tasks(settings)
    tasks = write_jsonl(tmp_path / "tasks.jsonl", judged.with_reference(train) if reward == "judge" else train)
    eval_tasks = write_jsonl(tmp_path / "heldout.jsonl", held)
    config = runner._loop_config(tmp_path, kind, settings, tmp_path / "model", tasks, eval_tasks, None, None)
    return judged.judged_config(config) if reward == "judge" else config


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model", "tiny"], "only --task calculator has a judge (SmolLM2's base weights with"),
        (["--task", "tools"], "scripts/demo/judge_rubric.md), not tools"),
        (["--task", "roles"], "scripts/demo/judge_rubric.md), not roles"),
        (["--async"], "--reward judge judges each round's episodes once they are collected: not with --async"),
    ],
)
def test_reward_judge_is_refused_where_it_makes_no_sense_with_one_line(tmp_path, args, says):
    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--reward", "judge", "--out", str(out), *args])
    assert result.exit_code == 2 and says in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()  # refused before anything ran
    result = CliRunner().invoke(app, ["demo", "--reward", "nope", "--out", str(out)])
    assert result.exit_code == 2 and "--reward 'nope': choose one of verifier, judge" in result.output


def test_the_judge_rewards_training_episodes_and_the_exact_verifier_the_held_out_ones(tmp_path, monkeypatch):
    exact = demo_config(tmp_path / "exact", "verifier")
    config = demo_config(tmp_path / "judge", "judge")
    assert exact.eval_verifier is None and exact.collect.verifier.endswith("verify.py:verify")  # today's demo
    assert config.collect.verifier == f"judge:{judged.demo_dir() / judged.RUBRIC}"
    assert config.collect.judge_mode == "pointwise" and config.eval_verifier == exact.collect.verifier
    # the exact verifier only measures: the held-out result promotes every round whatever it says
    assert config.options.promote_margin > 1 and replace(config, eval_verifier=None).key() != config.key()

    seen: dict[str, str | None] = {}

    def collect(store, *, options, **_):  # what each of the loop's collects is told, no agent run
        seen[options.split] = options.verifier
        return FakeResult()

    monkeypatch.setattr(steps, "collect_episodes", collect)
    monkeypatch.setattr(steps, "split_reward", lambda *a: (None, 0))
    for split in ("train", "eval"):
        steps.collect_split(None, config, 1, split, config.tasks, 2)
    assert seen == {"train": config.collect.verifier, "eval": exact.collect.verifier}

    # the judge is shown the right answer as the reference, through the bundled rubric
    task = json.loads(Path(config.tasks).read_text().splitlines()[0])
    prompt = pointwise_prompt(Rubric.load(config.collect.verifier), Sample("e", task, {}), 6000)[-1]["content"]
    assert "reference answer exactly" in prompt and f'<reference>\n"Answer: {task["answer"]}"' in prompt


class FakeResult:
    """collect_episodes' result, for the wiring test above (no agent runs in the unit tier)."""

    episodes, failed, skipped, run_id = 2, 0, 0, "run"


def test_a_demo_folder_of_one_reward_refuses_the_other(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    # a marker written before --reward was a run on the exact verifier's rewards
    for earlier in ({"reward": "verifier"}, {}, {"reward": "judge"}):
        (out / "demo.json").write_text(json.dumps({"task": "calculator", "model": "smollm2", "seed": 0, **earlier}))
        asked = "verifier" if earlier.get("reward") == "judge" else "judge"
        result = CliRunner().invoke(app, ["demo", "--reward", asked, "--out", str(out)])
        said = earlier.get("reward", "verifier")
        assert result.exit_code == 2 and f"holds a demo run with --reward {said}" in result.output, result.output


def test_training_episodes_are_labelled_with_the_exact_verdict_and_the_agreement_is_read_per_round(tmp_path):
    store = Store(tmp_path / "lcap.duckdb")
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [{"id": "t1", "answer": "3965"}, {"id": "t2", "answer": "1150"}])
    # (task, what the agent printed, the judge's score): right and judged right, wrong and judged right, ...
    episodes = {
        "a": ("t1", "Answer: 3965", 1.0),
        "b": ("t1", "Answer: 3966", 0.9),
        "c": ("t2", "Answer: 1150", 0.8),
        "d": ("t2", "I think 1150", 0.1),
        "e": ("t2", "Answer: 12", None),  # the judge failed: unrewarded, no agreement either way
    }
    for eid, (task, said, score) in episodes.items():
        work = tmp_path / "episodes" / eid / "work"
        work.mkdir(parents=True)
        (work.parent / "stdout.txt").write_text(f"{said}\n")
        labels = {"task": task, "round": "1", "split": "train"}
        store.start_episode(eid, command="agent", cwd=str(work), labels=labels)
        store.end_episode(eid, status="ok", exit_code=0)
        if score is not None:
            store.add_reward(eid, score, details="{}", source="judge:rubric.md")
    store.start_episode("judge-1", command="lcap judge", cwd=None, labels={"role": "judge", "judged": "a"})
    store.end_episode("judge-1", status="ok", exit_code=0)
    rewards = store.fetchall("SELECT count(*) FROM rewards")

    assert judged.label_exact(store, tasks) == 5 and judged.label_exact(store, tasks) == 0  # once each
    labels = dict(store.fetchall("SELECT episode_id, labels->>'exact_right' FROM episodes"))
    assert labels == {"a": "true", "b": "false", "c": "true", "d": "false", "e": "false", "judge-1": None}
    assert store.fetchall("SELECT count(*) FROM rewards") == rewards  # a label, never a reward
    assert store.fetchall("SELECT reward FROM episode_summary WHERE episode_id = 'b'") == [(0.9,)]

    ((row),) = judged.agreement_by_round(store)
    assert row["round"] == 1 and row["episodes"] == 4 and row["agreement"] == 0.75  # b disagrees
    assert row["judge_right"] == pytest.approx(0.9) and row["judge_wrong"] == pytest.approx(0.5)
    lines = judged.reward_lines("judge", [row])
    assert "judge only" in lines[0] and "agreement 0.750 over 4 training episodes" in lines[1]
    assert "exact verifier" in judged.reward_lines("verifier", [])[0]


def test_check_reward_passes_the_calculator_and_anything_under_the_verifier():
    calculator = runner.demo_task("calculator")
    judged.check_reward("judge", calculator, LoopOptions())
    judged.check_reward("verifier", runner.demo_task("number"), LoopOptions(overlap=True))
    with pytest.raises(LcapError, match="only --task calculator has a judge"):
        judged.check_reward("judge", runner.demo_task("number"), None)
