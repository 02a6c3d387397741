"""build-dataset --role on real DuckDB stores: a role's samples hold its calls' tokens only, its baseline is computed
over the episodes with a call of it, its weights per episode are its own; a role with no call is a clear error."""

from __future__ import annotations

import statistics

import pyarrow.parquet as pq
import pytest

from lcap.config import LcapError
from lcap.dataset.build.builder import BuildOptions, build_dataset

PLANNER_SYSTEM, SOLVER_SYSTEM = [1, 2, 3], [4, 5, 6]
REWARDS = (1.0, 0.0, 0.5, 0.0)  # of t0-0 .. t0-3; t0-3 has no solver call


def _calls(system: list[int], completions: list[list[int]], role: str | None) -> list[dict]:
    """One role's conversation: each prompt extends the one before (prompt + completion + env 90)."""
    prompt, out = list(system), []
    for completion in completions:
        out.append({"prompt_token_ids": list(prompt), "completion_token_ids": list(completion), "role": role})
        prompt = prompt + list(completion) + [90]
    return out


def _interleave(*threads: list[dict]) -> list[dict]:
    """The calls of several roles in the order they were made: one of each in turn."""
    longest = max(len(t) for t in threads)
    return [t[k] for k in range(longest) for t in threads if k < len(t)]


@pytest.fixture
def two_roles(builder, dstore):
    """Task t0, four episodes: a planner (completion ids 10-19) in each, a solver (ids 20-29) in the first three.
    t0-1's solver splits in two samples (its second call rewrites the history); t1-0, a group of one, is all solver."""
    for i, reward in enumerate(REWARDS):
        planner = _calls(PLANNER_SYSTEM, [[10 + i, 11], [12, 13]], "planner")
        solver = _calls(SOLVER_SYSTEM, [[20 + i], [21, 22]], "solver") if i < 3 else []
        if i == 1:
            solver[1]["prompt_token_ids"] = [7, 8]  # rewritten: a second sample of the solver
        builder.episode(f"t0-{i}", sample=i, reward=reward, turns=_interleave(planner, solver))
    builder.episode("t1-0", task="t1", reward=1.0, turns=_calls(SOLVER_SYSTEM, [[25]], "solver"))
    return dstore


def _build(store, tmp_path, role, **options):
    out = tmp_path / f"data-{role}"
    report = build_dataset(store, round=1, out=out, options=BuildOptions(keep_zero_variance=True, **options), role=role)
    return report, pq.read_table(out / "samples.parquet").to_pylist()


def _model_tokens(row: dict) -> list[int]:
    return [t for t, m in zip(row["completion_ids"], row["env_mask"], strict=True) if m]


def test_a_roles_samples_hold_its_own_calls_tokens_only(two_roles, tmp_path):
    calls = two_roles.fetchall("SELECT episode_id, role, completion_token_ids FROM turns ORDER BY episode_id, seq")
    for role in ("planner", "solver"):
        report, rows = _build(two_roles, tmp_path, role)
        mine = {}
        for episode, call_role, completion in calls:
            if call_role == role:
                mine.setdefault(episode, []).extend(completion)
        built = {}
        for row in sorted(rows, key=lambda r: r["sample_id"]):
            built.setdefault(row["episode_id"], []).extend(_model_tokens(row))
        assert built == mine  # every token the loss sees is the role's, and every one of the role's is seen
        assert report.role == role and report.title() == f"round 1 (train) role {role}"

    _, planner = _build(two_roles, tmp_path, "planner")
    merged = next(r for r in planner if r["episode_id"] == "t0-0")
    # the solver's calls between the planner's do not break the planner's conversation into pieces
    assert merged["prompt_ids"] == PLANNER_SYSTEM and merged["n_turns"] == 2
    assert merged["completion_ids"] == [10, 11, 90, 12, 13] and merged["env_mask"] == [1, 1, 0, 1, 1]


def test_the_baseline_is_the_roles_episodes_of_each_group_sharing_the_episodes_reward(two_roles, tmp_path):
    _, planner = _build(two_roles, tmp_path, "planner")
    _, solver = _build(two_roles, tmp_path, "solver")
    for rows, episodes in ((planner, ["t0-0", "t0-1", "t0-2", "t0-3"]), (solver, ["t0-0", "t0-1", "t0-2"])):
        rewards = [REWARDS[int(e[-1])] for e in episodes]
        mean, std = statistics.mean(rewards), statistics.stdev(rewards)
        for row in rows:
            if row["group_id"] != "1/train/t0":
                continue
            reward = REWARDS[int(row["episode_id"][-1])]
            assert row["reward"] == reward  # the episode's reward, shared by its roles
            assert row["advantage"] == pytest.approx((reward - mean) / (std + 1e-4))
    assert {r["episode_id"] for r in planner} == {"t0-0", "t0-1", "t0-2", "t0-3"}
    assert {r["episode_id"] for r in solver} == {"t0-0", "t0-1", "t0-2", "t1-0"}  # t1 has the solver only
    by_episode = {r["episode_id"]: r["advantage"] for r in solver}
    assert by_episode["t0-0"] != pytest.approx(
        next(r["advantage"] for r in planner if r["episode_id"] == "t0-0")
    )  # the same reward, another baseline


def test_episode_weights_are_per_role(two_roles, tmp_path):
    _, solver = _build(two_roles, tmp_path, "solver")
    _, planner = _build(two_roles, tmp_path, "planner")
    solver_weights = sorted((r["sample_id"], r["weight"]) for r in solver if r["episode_id"] == "t0-1")
    assert solver_weights == [("t0-1#0", 0.5), ("t0-1#1", 0.5)]  # the solver's two samples of t0-1 weigh 1 in all
    assert {r["weight"] for r in planner} == {1.0}  # the planner's one sample per episode weighs 1
    _, every = _build(two_roles, tmp_path, None)
    assert sum(r["weight"] for r in every if r["episode_id"] == "t0-1") == pytest.approx(1.0)
    _, sample = _build(two_roles, tmp_path / "sample", "solver", sample_weight="sample")
    assert {r["weight"] for r in sample} == {1.0}


def test_the_report_counts_each_role(two_roles, tmp_path):
    report, _ = _build(two_roles, tmp_path, "solver")
    assert report.roles == {"planner": {"calls": 8, "episodes": 4}, "solver": {"calls": 7, "episodes": 4}}
    assert report.turns["total"] == 7  # the solver's calls
    assert report.episodes["total"] == 4 and report.episodes["rewarded"] == 4  # the episodes with a solver call
    text = "\n".join(report.lines())
    assert "roles: planner 8 calls in 4 episodes, solver 7 calls in 4 episodes" in text
    assert "over the episodes with a call of role solver" in text
    stored = two_roles.fetchall("SELECT report->>'role' FROM dataset_reports")
    assert stored == [("solver",)]


def test_a_role_with_no_call_names_the_roles_there_are(two_roles, tmp_path):
    with pytest.raises(LcapError) as err:
        build_dataset(two_roles, round=1, out=tmp_path / "coder", role="coder")
    assert str(err.value) == (
        "--role coder: no call of that role in round 1 (train) (roles there: planner, solver); "
        "the store holds roles: planner, solver"
    )
    assert not (tmp_path / "coder").exists()  # nothing made for a build that cannot be
    with pytest.raises(LcapError, match=r"no call of that role in round 2 \(train\) \(roles there: none"):
        build_dataset(two_roles, round=2, out=tmp_path / "r2", role="planner")


def test_calls_captured_before_roles_are_the_default_role(builder, dstore, tmp_path):
    for i, reward in enumerate((1.0, 0.0)):
        builder.episode(f"old-{i}", sample=i, reward=reward, turns=_calls(PLANNER_SYSTEM, [[10 + i]], None))
    report, rows = _build(dstore, tmp_path, "default")
    assert report.roles == {"default": {"calls": 2, "episodes": 2}} and len(rows) == 2


def test_a_role_within_a_where_selection_and_another_baseline(two_roles, tmp_path):
    out = tmp_path / "sel"
    options = BuildOptions(where="task_id = 't0'", advantage="rloo", keep_zero_variance=True)
    report = build_dataset(two_roles, round=None, out=out, options=options, role="solver")
    rows = pq.read_table(out / "samples.parquet").to_pylist()
    assert {r["episode_id"] for r in rows} == {"t0-0", "t0-1", "t0-2"}
    got = {r["episode_id"]: r["advantage"] for r in rows}
    assert got["t0-0"] == pytest.approx(1.0 - (0.0 + 0.5) / 2)  # leave-one-out over the solver's episodes
    assert report.title() == "every round (train) role solver where task_id = 't0'"


def test_the_command_builds_a_role_and_names_the_roles_when_it_has_none(two_roles, tmp_path):
    from typer.testing import CliRunner

    from lcap.cli import app

    db = str(two_roles.path)
    out = tmp_path / "planner"
    built = CliRunner().invoke(
        app, ["build-dataset", "--round", "1", "--role", "planner", "--out", str(out), "--db", db]
    )
    assert built.exit_code == 0, built.output
    assert built.output.startswith(f"round 1 (train) role planner: 4 samples -> {out}")
    assert "roles: planner 8 calls in 4 episodes, solver 7 calls in 4 episodes" in built.output
    missing = CliRunner().invoke(
        app, ["build-dataset", "--round", "1", "--role", "coder", "--out", str(tmp_path / "c"), "--db", db]
    )
    assert missing.exit_code == 2
    assert missing.output.strip() == (
        "lcap: --role coder: no call of that role in round 1 (train) (roles there: planner, solver); "
        "the store holds roles: planner, solver"
    )
