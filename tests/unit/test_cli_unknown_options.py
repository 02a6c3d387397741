"""Unknown options before `--` are an error naming them on every command that takes an agent command (#51 row 3):
before, collect and loop passed `--bogus-flag` to the agent as its first arguments."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lcap.cli import app


@pytest.mark.parametrize(
    "args",
    [
        ["proxy", "--bogus-flag", "--", "true"],
        ["collect", "--tasks", "t.jsonl", "--bogus-flag", "--", "true"],
        ["collect", "--bogus-flag", "--tasks", "t.jsonl", "--", "true"],
        ["loop", "--run", "r", "--rounds", "1", "--tasks", "t.jsonl", "--bogus-flag", "--", "true"],
        ["loop", "--bogus-flag", "--run", "r", "--rounds", "1", "--", "true"],
    ],
)
def test_an_unknown_option_before_the_agent_command_is_named(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "No such option: --bogus-flag" in result.output


@pytest.mark.parametrize("separator", [["--"], []])
def test_the_agent_commands_own_options_are_its_own(separator, tmp_path, monkeypatch):
    """After `--`, or after the command's first word, options belong to the agent: collect reads on (and stops at
    the tasks file that is not there)."""
    monkeypatch.chdir(tmp_path)
    args = ["collect", "--tasks", "missing.jsonl", "--db", "s.duckdb", *separator, "agent", "--bogus-flag"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "cannot read tasks" in result.output and "No such option" not in result.output
