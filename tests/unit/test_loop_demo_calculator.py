"""`lcap demo --model smollm2`: the calculator task's questions, its agent's tool, which task each model runs, and the
pretrained model's learning bar (relative to its base). The run itself is measured: docs/benchmarks.md."""

from __future__ import annotations

import pytest

from lcap.config import LcapError
from lcap.loop.demo import calculator
from lcap.loop.demo.runner import TARGET_FROM_BEST, TARGET_GAIN, check_targets, demo_task
from lcap.loop.demo.task import load_script


def agent():
    return load_script(calculator.agent_path(), "calculator_agent_under_test")


def test_questions_are_distinct_products_apart_from_the_agents_worked_examples():
    train, held = calculator.make_tasks([], n_train=64, n_eval=64, seed=1)
    pairs = [
        tuple(sorted(map(int, t["question"].removeprefix("What is ").rstrip("?").split(" * ")))) for t in train + held
    ]
    assert len(set(pairs)) == len(pairs) == 128  # either order is one question; none in both sets
    assert not set(pairs) & {tuple(sorted(p)) for p in agent().EXAMPLES}
    assert all(str(a * b) == t["answer"] for (a, b), t in zip(pairs, train + held, strict=True))
    assert all(calculator.LOW <= n <= calculator.HIGH for p in pairs for n in p)
    assert calculator.make_tasks([], n_train=64, n_eval=64, seed=1) == (train, held)  # a seed is one task set


def test_the_agents_calculator_evaluates_arithmetic_and_nothing_else():
    calculate = agent().calculate
    assert calculate("61 * 65") == "3965" and calculate("(2 + 3) * -4") == "-20" and calculate("7 / 2") == "3.5"
    for hostile in ("__import__('os').system('id')", "2 ** 99999999", "1 / 0", "(" * 500 + "1" + ")" * 500, "x"):
        assert calculate(hostile).startswith("error: ")


def test_each_model_runs_its_own_task():
    assert demo_task(None).name == "calculator" and demo_task(None, "tiny").name == "number"
    assert demo_task(None).settings().rounds == 3 and demo_task(None, "tiny").settings().rounds == 5
    assert demo_task(None, "smollm2").name == "calculator" and demo_task("calculator").model == "smollm2"
    with pytest.raises(LcapError, match="--task tools trains the tiny model: with --model smollm2, choose calculator"):
        demo_task("tools", "smollm2")
    with pytest.raises(LcapError, match="no demo task 'nope'"):
        demo_task("nope")


def rounds(*right: float) -> list[dict]:
    return [dict(round=n, episodes=64, reward=r, well_formed=1.0, right=r) for n, r in enumerate(right)]


def test_a_pretrained_models_bar_is_its_gain_over_its_base_and_no_fall_from_its_best():
    assert check_targets(rounds(0.2, 0.3, 0.5), pretrained=True)[0]
    # an absolute bar the tiny model would pass is no gain for a model that starts there
    assert check_targets(rounds(0.8, 0.9, 0.95))[0] and not check_targets(rounds(0.8, 0.9, 0.95), pretrained=True)[0]
    assert not check_targets(rounds(0.2, 0.3, 0.2 + TARGET_GAIN - 0.01), pretrained=True)[0]
    passed, lines = check_targets(rounds(0.2, 0.7, 0.7 - TARGET_FROM_BEST - 0.01), pretrained=True)
    assert not passed and [line.split()[0] for line in lines] == ["ok", "MISS"]
    assert not check_targets(rounds(0.2), pretrained=True)[0]
