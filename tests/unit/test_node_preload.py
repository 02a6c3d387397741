"""Which agent commands start Node (and so need lcap's preload to be captured)."""

from __future__ import annotations

import sys

import pytest

from lcap.capture.reach.node_preload import runs_node


def _script(tmp_path, name: str, first_line: str):
    path = tmp_path / name
    path.write_text(f"{first_line}\nconsole.log(1)\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["node", "agent.mjs"],
        ["/usr/local/bin/node", "agent.js"],
        ["npx", "tsx", "agent.ts"],
        ["env", "-u", "X", "FOO=1", "node", "agent.js"],
        ["/usr/bin/env", "-S", "node", "agent.js"],
    ],
)
def test_node_programs(argv):
    assert runs_node(argv)


def test_scripts_by_their_shebang(tmp_path):
    assert runs_node([_script(tmp_path, "a", "#!/usr/bin/env node")])
    assert runs_node([_script(tmp_path, "b", "#!/usr/bin/env -S node --no-warnings")])
    assert runs_node([_script(tmp_path, "c", "#!/usr/bin/node")])
    assert not runs_node([_script(tmp_path, "d", "#!/usr/bin/env python3")])
    assert not runs_node([_script(tmp_path, "e", "#!/bin/sh")])
    looping = tmp_path / "f"
    looping.write_text(f"#!{looping}\n")  # a shebang naming itself is not followed
    assert not runs_node([str(looping)])


@pytest.mark.parametrize("argv", [[sys.executable, "agent.py"], ["python", "node.py"], ["missing-program"], []])
def test_other_programs(argv):
    assert not runs_node(argv)
