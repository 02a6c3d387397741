"""A Node agent before `lcap setup node`: Node ignores HTTPS_PROXY, so without lcap's preload its calls would leave
the machine uncaptured. `lcap proxy`, `lcap collect` (and `lcap loop`, through the same check) install the preload
on first need, or refuse with one line naming `lcap setup node`; the agent never runs uncaptured.

The refusal is made deterministic with an `npm` on PATH that exits 1 (the real one would reach the registry); the
install is the real `npm install` from the registry."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fixtures_capture import agent, run_lcap, turns

MARK = "ran-uncaptured"


@pytest.fixture
def no_preload(capture_env, tmp_path) -> dict[str, str]:
    """capture_env with an empty preload folder and an npm that fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    npm.write_text("#!/bin/sh\necho 'npm ERR! network unreachable' >&2\nexit 1\n")
    npm.chmod(0o755)
    return {**capture_env, "LCAP_NODE_DIR": str(tmp_path / "node"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _node_agents(tmp_path: Path) -> list[list[str]]:
    """Ways to start a Node agent that writes MARK in tmp_path when it runs: node, a node shebang, env node, npx."""
    code = f"require('fs').writeFileSync({json.dumps(str(tmp_path / MARK))}, 'x')"
    script = tmp_path / "agent"
    script.write_text(f"#!/usr/bin/env node\n{code}\n")
    script.chmod(0o755)
    return [
        ["node", "-e", code],
        [str(script)],
        ["env", "FOO=1", "node", "-e", code],
        ["npx", "--yes", "node", "-e", code],
    ]


def test_node_agent_is_refused_when_the_preload_cannot_be_installed(no_preload, llm, tmp_path):
    db = Path(no_preload["LCAP_DB"])
    for command in _node_agents(tmp_path):
        result = run_lcap(["proxy", "--upstream", llm.url, "--", *command], no_preload)
        assert result.returncode == 2, (command, result.stderr)
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("lcap: ") and "`lcap setup node`" in last, (command, result.stderr)
        assert not (tmp_path / MARK).exists(), command  # the agent never ran
    assert not db.exists() or turns(str(db)) == []
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t1"}\n')
    result = run_lcap(
        [
            "collect",
            "--tasks",
            str(tasks),
            "--upstream",
            llm.url,
            "--run-dir",
            str(tmp_path / "run"),
            "--",
            "node",
            "-e",
            f"require('fs').writeFileSync({json.dumps(str(tmp_path / MARK))}, 'x')",
        ],
        no_preload,
    )
    assert result.returncode == 2 and "`lcap setup node`" in result.stderr.strip().splitlines()[-1], result.stderr
    assert not (tmp_path / MARK).exists()
    result = run_lcap(
        [
            "loop",
            "--rounds",
            "1",
            "--tasks",
            str(tasks),
            "--run",
            str(tmp_path / "loop"),
            "--",
            *_node_agents(tmp_path)[1],
        ],
        no_preload,
    )
    assert result.returncode == 2 and "`lcap setup node`" in result.stderr.strip().splitlines()[-1], result.stderr
    assert not (tmp_path / MARK).exists()


def test_python_agent_needs_no_preload(no_preload, llm):
    """The check is for Node agents only: a Python agent runs without the preload and without an npm."""
    result = run_lcap(["proxy", "--upstream", llm.url, "--", *agent("openai_agent.py"), "chat"], no_preload)
    assert result.returncode == 0, result.stderr
    assert len(turns(no_preload["LCAP_DB"])) == 1


def test_node_agent_installs_the_preload_on_first_need(capture_env, llm, node_modules, tmp_path):
    """No preload installed, npm reachable: the first `lcap proxy` installs it (saying so), then captures the agent."""
    env = {**capture_env, "LCAP_NODE_DIR": str(tmp_path / "node"), "LCAP_TEST_NODE_MODULES": str(node_modules)}
    result = run_lcap(["proxy", "--upstream", llm.url, "--", "node", str(agent("openai_agent.cjs")[1])], env)
    if result.returncode == 2 and "could not install" in result.stderr:
        pytest.skip(f"the npm registry cannot be reached: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "installing it" in result.stderr and (tmp_path / "node" / "node_modules" / "undici").is_dir()
    assert [r["host"] for r in turns(capture_env["LCAP_DB"])] == ["api.openai.com"] * 2
