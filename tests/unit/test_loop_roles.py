"""`lcap loop --per-role` on real DuckDB stores: the roles a round trains are listed from the store, each role's
build and training is a step of its own (a resumed round skips the finished ones), a role with nothing to learn is
skipped alone, and what the loop deployed per role is found again after a restart. Training itself is replaced by
a recorder here (it needs TRL and a model: the loop on the vLLM CPU server, training for real, is
tests/e2e/test_loop_roles.py); the builds are real."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from fixtures_dataset import chat_turns

from lcap.config import LcapError
from lcap.dataset.options import BuildOptions, CollectOptions
from lcap.loop import rounds, steps
from lcap.loop.options import LoopOptions
from lcap.loop.roles import round_roles, train_roles
from lcap.loop.steps import LoopConfig, LoopState, StepRunner, StopAfter
from lcap.policy import PolicyServer, write_policy
from lcap.train.options import TrainOptions


def _call(role: str | None, completion: list[int], **more) -> dict:
    return {**chat_turns(completion)[0], "role": role, **more}


def _two_roles(builder) -> None:
    """Round 1: task t0's two episodes (reward 1 both) have a planner and a solver call; task t1's (rewards 1, 0) a
    planner call only. So the planner has a group that teaches, the solver only a group with one reward."""
    for i, reward in enumerate((1.0, 1.0)):
        builder.episode(f"t0-{i}", sample=i, reward=reward, turns=[_call("planner", [10 + i]), _call("solver", [20])])
    for i, reward in enumerate((1.0, 0.0)):
        builder.episode(f"t1-{i}", task="t1", sample=i, reward=reward, turns=[_call("planner", [12 + i])])


def test_the_rounds_roles_are_those_with_a_successful_call_in_its_training_episodes(builder, dstore):
    failed = {"status_code": 500, "error": "upstream said no"}
    builder.episode("a", reward=1.0, turns=[_call("planner", [5]), _call(None, [6]), _call("critic", [7], **failed)])
    builder.episode("b", sample=1, reward=0.0, turns=[_call("solver", [5])])
    builder.episode("e", split="eval", reward=1.0, turns=[_call("judge", [5])])  # held-out: not trained on
    builder.episode("r2", round=2, reward=1.0, turns=[_call("later", [5])])
    assert round_roles(dstore, 1) == ["default", "planner", "solver"]  # critic's only call failed: nothing to read
    assert round_roles(dstore, 2) == ["later"]
    assert round_roles(dstore, 1, "eval") == ["judge"]
    assert round_roles(dstore, 3) == []


@dataclasses.dataclass
class _Trained:
    output: Path
    metrics: dict


@pytest.fixture
def trainer(monkeypatch):
    """`train_round` replaced by a recorder that writes the role's adapter folder where the real one would."""
    calls: list[dict] = []

    def train_round(store, run, n, options, *, data, progress, init_from, role):
        calls.append({"round": n, "role": role, "data": data, "init_from": init_from})
        output = Path(run) / f"round-{n}" / f"role-{role}" / "adapter"
        output.mkdir(parents=True)
        return _Trained(output, {"loss": 0.5, "n_groups": 1, "n_samples": 2, "note": "not a number"})

    monkeypatch.setattr(steps, "train_round", train_round)
    return calls


def _config(tmp_path: Path) -> LoopConfig:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t0"}\n')
    return LoopConfig(
        run=tmp_path / "run",
        rounds=1,
        tasks=tasks,
        command=["agent"],
        collect=CollectOptions(group_size=2),
        build=BuildOptions(),
        train=TrainOptions(),
        options=LoopOptions(per_role=True),
    )


def test_each_role_is_built_and_trained_once_a_resume_skips_the_finished_ones(
    builder, dstore, tmp_path, trainer, record_env
):
    write_policy(PolicyServer("http://127.0.0.1:9", None, "/m", "m", "base", "", "py", "", roles={"solver": "s0"}))
    _two_roles(builder)
    config = _config(tmp_path)
    run = config.run
    lines: list[str] = []
    killed = StepRunner(dstore, LoopState(run, config.key()), run, stop_after=(1, "train:planner"))
    with pytest.raises(StopAfter):
        train_roles(killed, config, 1, lines.append)
    assert [c["role"] for c in trainer] == ["planner"]

    resumed = StepRunner(dstore, LoopState(run, config.key()), run)  # the same command again: state.json read back
    trained = train_roles(resumed, config, 1, lines.append)
    assert [c["role"] for c in trainer] == ["planner"]  # the planner's training was not redone; the solver's skipped
    assert trainer[0]["data"] == run / "round-1" / "role-planner" / "data"
    assert not isinstance(trainer[0]["init_from"], Path)  # the role's own previous adapter: train_round finds it
    assert list(trained) == ["planner"] and trained["planner"]["output"] == str(trainer[0]["data"].parent / "adapter")
    assert "note" not in trained["planner"]  # a step's record keeps the metrics that are numbers

    state = LoopState(run, config.key()).data["steps"]
    assert list(state) == ["1:roles", "1:build:planner", "1:train:planner", "1:build:solver", "1:skipped:solver"]
    assert state["1:roles"]["roles"] == ["planner", "solver"]
    assert state["1:build:planner"]["samples"] == 2  # t1's two episodes (t0's group has one reward: dropped)
    assert state["1:skipped:solver"] == {
        "reason": "every group got the same reward (1 of 1)",
        "kept": "s0",  # the solver's own deployment stays
        "seconds": state["1:skipped:solver"]["seconds"],
        "finished_at": state["1:skipped:solver"]["finished_at"],
    }
    assert not (run / "round-1" / "role-solver" / "data" / "samples.parquet").exists()
    assert dstore.fetchall("SELECT step FROM loop_steps ORDER BY created_at") == [
        ("roles",),
        ("build:planner",),
        ("train:planner",),
        ("build:solver",),
        ("skipped:solver",),
    ]  # each step recorded once, the killed run's included
    assert lines[-1] == "round 1 role solver: every group got the same reward (1 of 1): nothing to learn; s0 stays"
    planner_lines = [line for line in lines if line.startswith("round 1 role planner: ")]
    assert len(planner_lines) == 1 and planner_lines[0].endswith(f"| {run / 'round-1' / 'role-planner' / 'adapter'}")
    assert "warning: round 1 role planner trained on 1 group, fewer than --min-groups 2" in lines


def test_a_round_where_no_role_has_anything_to_learn_is_the_rounds_skip(builder, dstore, tmp_path, trainer, record_env):
    for i in range(2):
        builder.episode(f"t0-{i}", sample=i, reward=1.0, turns=[_call("planner", [10 + i]), _call("solver", [20])])
    config = _config(tmp_path)
    step = StepRunner(dstore, LoopState(config.run, config.key()), config.run)
    assert train_roles(step, config, 1, lambda _: None) == {} and trainer == []
    skipped = step.state.done(1, steps.SKIPPED)
    assert skipped is not None and skipped["reason"] == (
        "planner: every group got the same reward (1 of 1); solver: every group got the same reward (1 of 1)"
    )
    assert steps.solved(step.state, 1, 1, None)[0]  # --stop-when-solved counts it as any skipped round

    empty = StepRunner(dstore, LoopState(tmp_path / "run2", "k"), tmp_path / "run2")
    with pytest.raises(LcapError, match="round 2: no successful call in its training episodes"):
        train_roles(empty, config, 2, lambda _: None)


def test_per_role_is_refused_where_one_policy_is_trained_and_is_a_run_of_its_own(tmp_path):
    config = _config(tmp_path)
    for bad in (
        {"train": TrainOptions(full=True)},
        {"options": LoopOptions(per_role=True, overlap=True)},
        {"options": LoopOptions(per_role=True, sft_data="sft.parquet")},
    ):
        with pytest.raises(LcapError, match=r"^--per-role trains a LoRA adapter per role in synchronous rounds"):
            dataclasses.replace(config, **bad)
    with pytest.raises(LcapError, match=r"^--per-role trains"):
        dataclasses.replace(config, tasks=None, options=LoopOptions(per_role=True, live=True))
    assert config.key() != dataclasses.replace(config, options=LoopOptions()).key()  # a resume must not switch modes


def test_each_roles_latest_deployment_is_deployed_again_when_the_server_lost_it(tmp_path, record_env, monkeypatch):
    state = LoopState(tmp_path / "run", "k")
    first = {
        "planner": {"name": "p1", "path": "/r1/p", "round": 1},
        "solver": {"name": "s1", "path": "/r1/s", "round": 1},
    }
    state.finish(1, "deploy", {"roles": first})
    state.finish(2, "deploy", {"roles": {"planner": {"name": "p2", "path": "/r2/p", "round": 2}}})
    state.finish(3, "train:deploy", {"output": "/r3/d"})  # a role named `deploy`: its training is no deploy
    assert state.deployed_roles() == {"planner": {"name": "p2", "path": "/r2/p", "round": 2}, "solver": first["solver"]}
    assert state.last_deployed() == state.done(2, "deploy")

    deployed: list[tuple[dict, int]] = []  # deploy_roles hot-loads into vLLM: the real one runs in the e2e test
    monkeypatch.setattr(rounds, "deploy_roles", lambda adapters, round, store: deployed.append((adapters, round)))
    write_policy(PolicyServer("http://127.0.0.1:9", None, "/m", "m", "base", "", "py", "", roles={"planner": "p2"}))
    lines: list[str] = []
    rounds._redeploy_if_lost(state, None, lines.append)
    assert deployed == [({"solver": Path("/r1/s")}, 1)]  # the planner is still served: left alone
    assert lines == ["policy server does not serve solver s1: deploying them again"]
    write_policy(PolicyServer("http://127.0.0.1:9", None, "/m", "m", "base", "", "py", "", roles={}))
    deployed.clear()
    rounds._redeploy_if_lost(state, None, lines.append)
    assert deployed == [({"solver": Path("/r1/s")}, 1), ({"planner": Path("/r2/p")}, 2)]  # each under its round
