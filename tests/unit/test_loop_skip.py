"""A round with nothing to learn: `lcap loop` records it as skipped and goes on, `lcap train` refuses it, and
--stop-when-solved ends a loop on it (the loops themselves on the vLLM CPU server: tests/e2e/test_loop_skip.py)."""

from __future__ import annotations

import json
import time

import pytest
from fixtures_dataset import chat_turns

from lcap.config import LcapError
from lcap.dataset.build.builder import build_dataset
from lcap.loop.steps import SKIPPED, LoopState, StepRunner, solved, train_step
from lcap.train.fit import NothingToLearn, equal_rewards
from lcap.train.options import TrainOptions


def _round(builder, rewards: dict[str, list[float | None]]) -> None:
    for task, values in rewards.items():
        for i, reward in enumerate(values):
            builder.episode(f"{task}-{i}", task=task, sample=i, reward=reward, turns=chat_turns([5, 2]))


def test_equal_rewards_in_every_group_is_nothing_to_learn_not_an_error(builder, dstore, tmp_path):
    _round(builder, {"a": [1.0, 1.0], "b": [0.0, 0.0]})
    data = tmp_path / "run" / "round-1" / "data"
    build_dataset(dstore, round=1, out=data)
    with pytest.raises(NothingToLearn) as caught:
        train_step(dstore, tmp_path / "run", 1, TrainOptions(), data)
    assert caught.value.reason == "every group got the same reward (2 of 2)"
    assert isinstance(caught.value, LcapError)  # `lcap train` still refuses it, exit 2
    assert str(caught.value).startswith(f"round 1: nothing to train on in {data}: 2 of 2 groups got the same reward")


def test_a_group_with_one_reward_is_an_error_not_a_solved_round(builder, dstore, tmp_path):
    _round(builder, {"a": [1.0, 1.0], "b": [0.5, None]})  # b: one rewarded sample, not an equal group
    data = tmp_path / "run" / "round-1" / "data"
    build_dataset(dstore, round=1, out=data)
    with pytest.raises(LcapError) as caught:
        train_step(dstore, tmp_path / "run", 1, TrainOptions(), data)
    assert not isinstance(caught.value, NothingToLearn)


def test_equal_rewards_reads_the_report():
    groups = {"total": 8, "zero_variance": 8, "singleton": 0}
    assert equal_rewards({"groups": groups}) == "every group got the same reward (8 of 8)"
    assert (
        equal_rewards({"groups": {**groups, "zero_variance": 7, "singleton": 1}}) is None
    )  # zero_variance: groups of 2+
    assert equal_rewards({"groups": {**groups, "zero_variance": 7}}) is None
    assert equal_rewards({"groups": groups, "options": {"keep_zero_variance": True}}) is None
    assert equal_rewards({"groups": {"total": 0, "zero_variance": 0}}) is None
    assert equal_rewards(None) is None


def _state(tmp_path, steps: dict[str, dict]) -> LoopState:
    state = LoopState(tmp_path / "run", "k")
    for key, info in steps.items():
        round_, step = key.split(":")
        state.finish(int(round_), step, info)
    return state


def test_stop_when_solved_needs_k_skipped_rounds_in_a_row_and_held_out_no_worse(tmp_path):
    state = _state(
        tmp_path,
        {
            "0:eval": {"mean_reward": 0.25},
            "1:deploy": {"name": "r1"},
            "1:eval": {"mean_reward": 0.75},
            "2:skipped": {"reason": "x"},
            "3:deploy": {"name": "r3"},
            "3:eval": {"mean_reward": 0.5},
            "4:skipped": {"reason": "x"},
            "5:skipped": {"reason": "x"},
        },
    )
    measured = []

    def held_out(value):
        return lambda: measured.append(value) or {"mean_reward": value}

    assert solved(state, 5, 0, held_out(1.0)) == (False, None)  # not asked
    assert solved(state, 5, 3, held_out(1.0)) == (False, None)  # round 3 trained: two in a row, not three
    assert measured == []  # nothing measured before the streak is there
    stop, line = solved(state, 5, 2, held_out(0.5))  # against round 3's 0.5, the last deployed round's
    assert (
        stop
        and line
        == "stopping: 2 rounds in a row with nothing to learn, held-out reward 0.500 >= 0.500 (--stop-when-solved 2)"
    )
    stop, line = solved(state, 5, 2, held_out(0.25))
    assert not stop and line is not None and "0.250 < 0.500 when deployed: going on" in line
    assert solved(state, 5, 2, None)[0]  # no held-out tasks: the streak alone
    assert solved(state, 2, 1, held_out(0.75))[0] and not solved(state, 2, 1, held_out(0.5))[0]  # against round 1's


def test_a_skipped_round_is_recorded_once_with_its_reason(dstore, tmp_path, monkeypatch):
    from lcap.loop.steps import skip_step, skipped_line

    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "none.json"))  # no policy server: "the current one"
    step = StepRunner(dstore, LoopState(tmp_path / "run", "k"), tmp_path / "run")
    calls = []

    def train():
        calls.append(1)
        raise NothingToLearn("round 2: nothing", "every group got the same reward (4 of 4)")

    first = skip_step(step, 2, "train", train)
    again = skip_step(step, 2, "train", train)  # resumed: the recorded skip, not a second try
    assert calls == [1] and first["skipped"]["reason"] == again["skipped"]["reason"]
    rows = dstore.fetchall("SELECT round, step, details->>'reason' FROM loop_steps")
    assert rows == [(2, SKIPPED, "every group got the same reward (4 of 4)")]
    assert skipped_line("round 2", first["skipped"]) == (
        "round 2: every group got the same reward (4 of 4): nothing to learn; the current deployment stays"
    )
    with pytest.raises(LcapError, match="not this"):  # any other refusal still stops the loop
        skip_step(step, 3, "train", lambda: (_ for _ in ()).throw(LcapError("not this")))


def test_status_shows_a_skipped_round_and_the_held_out_reward(dstore, tmp_path):
    from lcap.loop.status import loop
    from lcap.status import View

    rows = [
        (1, "collect", 0.25, {}),
        (1, "eval", 0.5, {}),
        (2, "collect", 1.0, {}),
        (2, "skipped", None, {"reason": "every group got the same reward (3 of 3)", "kept": "r1"}),
    ]
    dstore.append(
        "loop_steps",
        [
            {
                "run": "/runs/a",
                "round": n,
                "step": step,
                "mean_reward": reward,
                "details": json.dumps(details),
                "created_at": f"2026-01-01 00:0{i}:00+00",
            }
            for i, (n, step, reward, details) in enumerate(rows)
        ],
    )
    section = loop(View(dstore.path, time.time()))
    assert section.rows[0][1:4] == ["skipped: every group got the same reward (3 of 3)", "2", "0.500"]
    assert section.data[0]["held_out_reward"] == 0.5  # the eval's, not the training collect's 1.0


def test_an_interrupted_loop_says_after_which_step(tmp_path):
    state = LoopState(tmp_path / "run", "k")
    assert state.where() == "before its first step finished"
    state.finish(0, "eval", {})
    state.finish(1, "collect", {})
    assert state.where() == "after round 1's collect"


def test_a_round_on_fewer_groups_than_min_groups_warns_with_the_count():
    from lcap.loop.steps import few_groups

    assert few_groups("round 1", {"n_groups": 1}, 2) == "warning: round 1 trained on 1 group, fewer than --min-groups 2"
    assert few_groups("step 3", {"n_groups": 2}, 3) == "warning: step 3 trained on 2 groups, fewer than --min-groups 3"
    assert few_groups("round 1", {"n_groups": 2}, 2) is None
    assert few_groups("round 1", {"n_samples": 4}, 2) is None  # an SFT round has no groups
