"""`lcap train --role R`'s layout and refusals, without a model: the role's folder, the adapter it continues (its own
latest, never another role's), the samples it accepts (its own build's only), full fine-tuning refused (the training
itself on the tiny model: tests/e2e/test_train_roles.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lcap.cli import app
from lcap.config import LcapError
from lcap.train.fit import round_name
from lcap.train.grpo import role_output, round_dir, round_inputs
from lcap.train.options import TrainOptions

OPTIONS = TrainOptions(base_model="tiny-model", current="d1")


def _adapter(run: Path, round: int, role: str | None = None) -> Path:
    path = round_dir(run, round, role) / "adapter"
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    return path


def _samples(run: Path, round: int, role: str | None, report: dict | None = None, *, bare: bool = False) -> Path:
    """RUN/round-N[/role-R]/data with a samples file and a build's `report` (default: of `role`; none if bare)."""
    data = round_dir(run, round, role) / "data"
    data.mkdir(parents=True)
    (data / "samples.parquet").write_bytes(b"")
    if not bare:
        (data / "report.json").write_text(json.dumps(report or {"role": role}))
    return data


def test_a_roles_round_has_its_folder_under_the_round(tmp_path):
    assert round_dir(tmp_path, 3, "planner") == tmp_path / "round-3" / "role-planner"
    assert round_dir(tmp_path, 3) == tmp_path / "round-3"
    assert round_name(round_dir(tmp_path, 3, "code-writer")) == "round 3 role code-writer"
    assert round_name(round_dir(tmp_path, 3)) == "round 3"
    for bad in ("../planner", "a/b", "", "..", " planner"):
        with pytest.raises(LcapError, match="a role names one folder of the run"):
            round_dir(tmp_path, 3, bad)


def test_a_role_continues_its_own_latest_adapter_never_anothers(tmp_path):
    run = tmp_path / "run"
    _adapter(run, 1)  # the run's single-role adapter
    _adapter(run, 1, "solver")
    planner_1 = _adapter(run, 1, "planner")
    _adapter(run, 2, "solver")  # the planner made no call in round 2: it has no adapter there
    _adapter(run, 3, "solver")
    assert role_output(run, 4, "planner") == planner_1  # from round 1, past the rounds it missed
    assert role_output(run, 4, "solver") == round_dir(run, 3, "solver") / "adapter"
    assert role_output(run, 2, "coder") is None  # its first round: the base model
    _samples(run, 4, "planner")
    assert round_inputs(run, 4, OPTIONS, role="planner").init_from == planner_1
    _samples(run, 2, "coder")
    assert round_inputs(run, 2, OPTIONS, role="coder").init_from is None
    _samples(tmp_path / "single", 2, None)
    with pytest.raises(LcapError, match="round 2 continues round 1's policy"):  # the single-role rule is unchanged
        round_inputs(tmp_path / "single", 2, OPTIONS)


def test_a_role_trains_on_its_own_build_only(tmp_path):
    run = tmp_path / "run"
    assert round_inputs(run, 1, OPTIONS, role="planner", data=_samples(tmp_path / "a", 1, "planner")).samples
    for built_for, said in ((None, "was built of every role's calls"), ("solver", "was built of role solver's calls")):
        data = _samples(tmp_path / f"b-{built_for}", 1, None, {"role": built_for})
        with pytest.raises(LcapError, match=f"--role planner: .* {said}: build it with `lcap build-dataset --role"):
            round_inputs(run, 1, OPTIONS, role="planner", data=data)
    bare = _samples(tmp_path / "c", 1, None, bare=True)
    with pytest.raises(LcapError, match=r"has no build-dataset report\.json beside it"):
        round_inputs(run, 1, OPTIONS, role="planner", data=bare)
    with pytest.raises(LcapError, match=r"round 2 role planner has no dataset in .*role-planner/data: run `lcap "):
        round_inputs(run, 2, OPTIONS, role="planner")


def test_full_fine_tuning_stays_single_role(tmp_path, monkeypatch):
    from dataclasses import replace

    _samples(tmp_path / "run", 1, "planner")
    with pytest.raises(LcapError, match="full fine-tuning stays single-role"):
        round_inputs(tmp_path / "run", 1, replace(OPTIONS, full=True), role="planner")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["train", "--round", "1", "--run", "run", "--role", "planner", "--full", "--db", "s.duckdb"]
    )
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "lcap: --role with --full: full fine-tuning stays single-role (one checkpoint serves every role)"
    ]
