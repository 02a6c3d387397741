"""`lcap demo --task roles`: its word problems, its verifier's per-role success, the rules that tell its agent's two
roles apart, the loop it runs (an adapter per role) and its per-role figures read from the store. The run itself is
measured, not tested (docs/guide.md, the roles demo)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lcap.capture.proxy.roles import parse_role_by
from lcap.config import LcapError
from lcap.loop.demo import roles
from lcap.loop.demo.runner import _loop_config, demo_task
from lcap.loop.demo.task import demo_dir, load_script
from lcap.loop.options import LoopOptions
from lcap.store import Store, now


@pytest.fixture
def agent():
    return load_script(roles.agent_path(), "planner_solver_agent_under_test")


def score(expected: str, stdout: str) -> dict:
    return load_script(demo_dir() / "verify_roles.py", "verify_roles_under_test").score(expected, stdout)


def numbers(problem: str) -> tuple[int, int]:
    a, b = map(int, re.findall(r"\d+", problem))
    return a, b


def test_problems_are_distinct_products_told_in_words_apart_from_the_agents_worked_examples(agent):
    train, held = roles.make_tasks([], n_train=64, n_eval=64, seed=1)
    pairs = [tuple(sorted(numbers(t["problem"]))) for t in train + held]
    assert len(set(pairs)) == len(pairs) == 128  # either order is one problem; none in both sets
    assert not set(pairs) & {tuple(sorted(p)) for p in agent.SOLVES}
    assert not set(pairs) & {tuple(sorted(numbers(problem))) for problem, _ in agent.PLANS}
    assert all(str(a * b) == t["answer"] for (a, b), t in zip(pairs, train + held, strict=True))
    templates = [re.sub(r"\d+", "{}", t["problem"]) for t in train + held]
    assert set(templates) == {p.replace("{a}", "{}").replace("{b}", "{}") for p in roles.PROBLEMS}
    assert roles.make_tasks([], n_train=64, n_eval=64, seed=1) == (train, held)  # a seed is one task set
    # every pair there is but the worked examples': none of theirs is ever drawn
    every = (roles.HIGH - roles.LOW + 1) * (roles.HIGH - roles.LOW + 2) // 2
    examples = {tuple(sorted(p)) for p in agent.SOLVES} | {tuple(sorted(numbers(p))) for p, _ in agent.PLANS}
    drawn = roles.make_tasks([], n_train=every - len(examples), n_eval=0, seed=2)[0]
    assert len(examples) == 3 and not {tuple(sorted(numbers(t["problem"]))) for t in drawn} & examples
    assert [t["id"] for t in train[:2] + held[:1]] == ["train-0", "train-1", "heldout-0"]


def test_the_verifier_rewards_the_answer_and_tells_each_roles_success_apart():
    both = score("3965", "Expression: 61 * 65\nAnswer: 3965\n")
    assert (both["reward"], both["right"], both["planner_right"], both["solver_right"]) == (1.0, True, True, True)
    assert both["expression"] == "61 * 65"
    # the planner wrote the wrong expression; the solver worked out the one it was given
    plan_wrong = score("3965", "Expression: 61 + 65\nAnswer: 126")
    assert (plan_wrong["reward"], plan_wrong["planner_right"], plan_wrong["solver_right"]) == (0.5, False, True)
    # the planner was right, the solver answered something else, or nothing well-formed
    solve_wrong = score("3965", "Expression: 65*61\nAnswer: 3966")
    assert (solve_wrong["reward"], solve_wrong["planner_right"], solve_wrong["solver_right"]) == (0.5, True, False)
    unformed = score("3965", "Expression: (61) * 65\nThe answer is 3965.")
    assert (unformed["reward"], unformed["planner_right"], unformed["solver_right"]) == (0.0, True, False)
    # an expression that evaluates to nothing leaves the solver nothing to get right: not measured
    for said in ("Expression: sixty-one times 65\nAnswer: 3965", "Expression: \nAnswer: 1", "Answer: 3965"):
        details = score("3965", said)
        assert details["solver_right"] is None and not details["planner_right"], said
    assert score("3965", "Expression: 61 * 65\nAnswer: 3965")["reward"] == 1.0  # the episode's right answer alone
    json.dumps(both)  # the details are stored as JSON


def test_the_role_rules_match_each_system_prompt_of_the_agent_and_nothing_else(agent):
    rules = parse_role_by(roles.ROLE_BY)

    def role(system: str) -> str | None:
        request = {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": system}]}
        return next((r.role for r in rules if r.matches(request)), None)

    assert role(agent.PLANNER) == "planner" and role(agent.SOLVER) == "solver"
    assert role("You are a helpful assistant.") is None


def test_the_roles_task_trains_an_adapter_per_role_with_its_own_verifier(tmp_path):
    task = demo_task("roles")
    assert task.model == "smollm2" and demo_task("roles", "smollm2") is task
    with pytest.raises(LcapError, match="--task roles trains the smollm2 model: with --model tiny"):
        demo_task("roles", "tiny")
    settings = task.settings()
    config = _loop_config(tmp_path, task, settings, tmp_path / "model", tmp_path / "t", tmp_path / "e", None, None)
    assert config.options.per_role and config.proxy.role_by == roles.ROLE_BY
    assert config.collect.verifier == f"{demo_dir() / 'verify_roles.py'}:verify"
    assert config.command[1] == str(roles.agent_path()) and "{problem}" in config.command
    # the calculator task keeps one adapter and the shared verifier
    single = _loop_config(tmp_path, demo_task("calculator"), settings, tmp_path, tmp_path, tmp_path, None, None)
    assert not single.options.per_role and single.proxy.role_by == ()
    assert single.collect.verifier.endswith("/verify.py:verify")
    with pytest.raises(LcapError, match="--per-role trains a LoRA adapter per role in synchronous rounds"):
        _loop_config(tmp_path, task, settings, tmp_path, tmp_path, tmp_path, None, LoopOptions(overlap=True))


def held_out(store: Store, n: int, details: list[dict]) -> None:
    for i, d in enumerate(details):
        episode = f"e{n}-{i}"
        store.start_episode(episode, command="agent", cwd=None, labels={"round": str(n), "split": "eval"})
        store.end_episode(episode, status="ok", exit_code=0)
        row = {"episode_id": episode, "value": 1.0, "details": json.dumps(d), "created_at": now()}
        store.append("rewards", [row])


def test_the_report_reads_each_roles_success_per_held_out_round_from_the_store(tmp_path: Path):
    store = Store(tmp_path / "lcap.duckdb")
    right = {"right": True, "planner_right": True, "solver_right": True}
    plan_only = {"right": False, "planner_right": True, "solver_right": False}
    unplanned = {"right": False, "planner_right": False, "solver_right": None}
    held_out(store, 0, [right, plan_only, unplanned, unplanned])
    held_out(store, 1, [right, right, right, plan_only])
    # an episode that crashed before its verifier: wrong for the planner and the episode, not measured for the solver
    store.start_episode("crashed", command="agent", cwd=None, labels={"round": "1", "split": "eval"})
    store.end_episode("crashed", status="failed", exit_code=1)
    report = roles.report(store)
    first, last = report["by_round"]
    assert first == dict(round=0, episodes=4, planner=0.5, solver=0.5, solver_measured=2, episode=0.25)
    assert last == dict(round=1, episodes=5, planner=0.8, solver=0.75, solver_measured=4, episode=0.6)
    assert "planner's expression right 0.50 -> 0.80" in report["line"]
    assert "whole episode right 0.25 -> 0.60" in report["line"]
    assert roles.report(Store(tmp_path / "empty.duckdb"))["by_round"] == []
