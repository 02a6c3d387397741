"""The demo's task, warm start and learning targets (the whole `lcap demo` run is measured, not tested:
docs/benchmarks.md#demo, scripts/demo/check_learning.py)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from lcap.loop.demo.number import NUMBERS, make_tasks
from lcap.loop.demo.runner import TARGET_FALLBACK, TARGET_REWARD, TARGET_RIGHT, check_targets, held_out_by_round
from lcap.loop.demo.task import words
from lcap.loop.demo.warm import Example, shared_prefix
from lcap.store import Store, now

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "demo"))


from verify import score


def test_tasks_are_distinct_triples_and_the_training_ones_cover_every_number_word():
    vocabulary = words()
    train, held = make_tasks(vocabulary, n_train=130, n_eval=32, seed=3)
    questions = [t["question"] for t in train + held]
    assert len(set(questions)) == len(questions) == 162  # no question twice, none in both sets
    counts = Counter(t["answer"] for t in train)
    assert set(counts) == {w for w in vocabulary if w in NUMBERS} and max(counts.values()) - min(counts.values()) <= 1
    for task in train + held:
        listed = task["question"].split(": ")[1].split()
        assert len(listed) == 3 and [w for w in listed if w in NUMBERS] == [task["answer"]]
    assert make_tasks(vocabulary, n_train=130, n_eval=32, seed=3) == (train, held)  # seeded


def test_the_warm_starts_shared_prefix_holds_no_trained_token():
    """The shared prefix runs once a step, outside the batch: it ends before the last shared token (whose logits
    predict the first that differs) and before the first token any example is trained on."""
    a = Example([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 1, 1])
    b = Example([1, 2, 3, 4, 7, 8, 9], [0, 0, 0, 0, 1, 1, 1])
    assert shared_prefix([a, b]) == 3  # tokens 1 2 3 run once; 4 stays in the batch to predict 5 and 7
    c = Example([1, 2, 3, 4, 7], [0, 0, 1, 0, 1])  # trains on its third token, inside the shared part
    assert shared_prefix([a, b, c]) == 1
    assert shared_prefix([Example([1, 2], [0, 1]), Example([3, 4], [0, 1])]) == 0


def test_verifier_rewards_a_right_answer_in_the_format_only():
    assert score("seven", "Answer: seven")["reward"] == 1.0
    assert score("seven", "Answer: tool")["reward"] == 0.5
    assert score("seven", "The answer is seven.")["reward"] == 0.0
    assert score("seven", "thinking...\nAnswer: seven\n")["right"]


def held_out_store(tmp_path: Path, rounds: dict[int, list[tuple[bool, bool]]]) -> Store:
    """A store with held-out episodes per round, each (well_formed, right), rewarded as the demo's verifier does."""
    store = Store(tmp_path / "lcap.duckdb")
    for n, answers in rounds.items():
        for i, (formed, right) in enumerate(answers):
            episode = f"e{n}-{i}"
            store.start_episode(episode, command="agent", cwd=None, labels={"round": str(n), "split": "eval"})
            store.end_episode(episode, status="ok", exit_code=0)
            reward = 1.0 if right else 0.5 if formed else 0.0
            store.append(
                "rewards",
                [
                    {
                        "episode_id": episode,
                        "value": reward,
                        "details": json.dumps({"well_formed": formed, "right": right}),
                        "created_at": now(),
                    }
                ],
            )
    return store


def test_targets_read_from_the_store(tmp_path):
    right, formed, wrong = (True, True), (True, False), (False, False)
    store = held_out_store(
        tmp_path, {0: [wrong] * 8 + [formed] * 2, 1: [right] * 7 + [formed] * 3, 2: [right] * 8 + [formed] * 2}
    )
    rows = held_out_by_round(store)
    assert [(r["round"], r["episodes"], r["reward"], r["right"]) for r in rows] == [
        (0, 10, pytest.approx(0.1), 0.0),
        (1, 10, pytest.approx(0.85), pytest.approx(0.7)),
        (2, 10, pytest.approx(0.9), pytest.approx(0.8)),
    ]
    assert check_targets(rows)[0]

    # Each target alone fails it: a low last reward, few right answers, a fall from the round before.
    last = rows[-1]
    assert not check_targets(rows[:-1] + [{**last, "reward": TARGET_REWARD - 0.01}])[0]
    assert not check_targets(rows[:-1] + [{**last, "right": TARGET_RIGHT - 0.01}])[0]
    before = {**rows[1], "right": last["right"] + TARGET_FALLBACK + 0.01}
    passed, lines = check_targets([rows[0], before, last])
    assert not passed and [line.split()[0] for line in lines] == ["ok", "ok", "ok", "MISS"]


def test_held_out_counts_a_crashed_or_unrewarded_episode_as_wrong(tmp_path):
    """An episode that crashed, timed out or went unrewarded is a wrong answer in the held-out figures, never out of
    the denominator; one still running (or interrupted, run again on resume) is not counted yet."""
    right = (True, True)
    store = held_out_store(tmp_path, {1: [right] * 2})
    for episode, status in (("crashed", "failed"), ("slow", "timeout"), ("running", None), ("stopped", "interrupted")):
        store.start_episode(episode, command="agent", cwd=None, labels={"round": "1", "split": "eval"})
        if status:
            store.end_episode(episode, status=status, exit_code=1)
    ((row),) = held_out_by_round(store)
    assert (row["episodes"], row["reward"], row["right"], row["well_formed"]) == (4, 0.5, 0.5, 0.5)


def test_demo_refuses_a_folder_of_another_seed_or_model_and_exits_1_when_it_misses_its_targets(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from lcap.cli import app
    from lcap.loop.demo import runner

    out = tmp_path / "demo"
    out.mkdir()
    (out / "demo.json").write_text(json.dumps({"task": "calculator", "model": "smollm2", "seed": 0}))
    result = CliRunner().invoke(app, ["demo", "--seed", "1", "--out", str(out)])
    assert result.exit_code == 2 and "holds a demo run with --seed 0" in result.output and "--fresh" in result.output
    assert json.loads((out / "demo.json").read_text())["seed"] == 0  # nothing of the earlier run is touched

    # The exit code follows the targets' verdict (the run itself is measured by scripts/demo.sh, not tested here).
    for passed, code in ((False, 1), (True, 0)):
        monkeypatch.setattr(runner, "run_demo", lambda *a, passed=passed, **k: {"targets": {"passed": passed}})
        result = CliRunner().invoke(app, ["demo", "--out", str(out)])
        assert result.exit_code == code, result.output


def test_a_refused_round_is_not_the_policy_the_run_ends_with(tmp_path):
    """With --eval-tasks the loop refuses a round whose candidate is worse on the held-out tasks: its eval episodes
    are the candidate's, which never served, so the targets judge the last promoted round instead."""
    right, formed = (True, True), (True, False)
    store = held_out_store(tmp_path, {0: [formed] * 10, 1: [right] * 9 + [formed], 2: [formed] * 10})
    for n, promoted in ((1, True), (2, False)):
        store.append("loop_steps", [{"round": n, "step": "promote", "details": json.dumps({"promoted": promoted})}])
    rows = held_out_by_round(store)
    assert [r["promoted"] for r in rows] == [None, True, False]
    passed, lines = check_targets(rows)
    assert passed and all("round 2" not in line for line in lines)  # round 1 serves: its figures are judged
    assert not check_targets([{**r, "promoted": None} for r in rows])[0]  # counted as served, round 2 would fail


def test_the_greedy_control_is_read_back_as_lcap_eval_rows(tmp_path):
    """The summary's greedy rows: `lcap eval`'s figures of each deployment's latest `demo-greedy` collect (an earlier
    one, or another evaluation's, is not read), named base or by the round deployed, in the order they ran."""
    from lcap.loop.demo.control import LABEL, greedy_summary

    store = Store(tmp_path / "lcap.duckdb")
    runs = [("base", "c-old", 1, [0, 0]), ("base", "c-base", 2, [1, 0]), ("policy-r1", "c-r1", 3, [1, 1])]
    runs += [("policy-r1", "c-other", 4, [0, 0])]  # another evaluation of the same deployment: not the control's
    for deployment, run, n, rewards in runs:
        label = LABEL if run != "c-other" else "eval-by-hand"
        for i, reward in enumerate(rewards):
            episode = f"{run}-{i}"
            labels = {"round": str(n), "split": "compare", "collect": run, "task": f"t{i}"}
            store.start_episode(
                episode, command="agent", cwd=None, labels={**labels, "eval": label, "deployment": deployment}
            )
            store.end_episode(episode, status="ok", exit_code=0)
            store.append(
                "rewards", [{"episode_id": episode, "value": float(reward), "details": "{}", "created_at": now()}]
            )
    store.append(
        "deployments",
        [
            {"name": "base", "path": "m", "base_model": "m", "kind": "base", "round": None, "created_at": now()},
            {"name": "policy-r1", "path": "a", "base_model": "m", "kind": "lora", "round": 1, "created_at": now()},
        ],
    )
    control = greedy_summary(store)
    assert [(r["deployment"], r["collect_run"], r["of_round"], r["episodes"], r["right"]) for r in control["rows"]] == [
        ("base", "c-base", 0, 2, 0.5),
        ("policy-r1", "c-r1", 1, 2, 1.0),
    ]
    assert control["line"] == "greedy (temperature 0) right answers: base 0.50 -> round 1 1.00"
    assert "| base | base | 2 | 0.500 |" in control["markdown"]
