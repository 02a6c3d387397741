"""What a `--sandbox` agent is shown of the host (capture/sandbox_view.py), from real files in a temporary folder:
a script's folder and its `#!` interpreter's venv and installation, never the host's /, /etc's secrets hidden."""

from __future__ import annotations

import os
from pathlib import Path

from lcap.capture.sandbox_view import SECRETS, command_paths, outside_system, share_args, system_args


def _venv(root: Path) -> Path:
    """A venv at root/venv whose python links to an installation at root/python (bin/python3.x, lib/)."""
    (root / "python" / "bin").mkdir(parents=True)
    (root / "python" / "lib").mkdir()
    real = root / "python" / "bin" / "python3.99"
    real.write_text("")
    real.chmod(0o755)
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "pyvenv.cfg").write_text(f"home = {real.parent}\n")
    (root / "venv" / "bin" / "python").symlink_to(real)
    return root / "venv" / "bin" / "python"


def test_a_script_shows_its_folder_and_its_interpreters_venv_and_installation(tmp_path):
    python = _venv(tmp_path)
    (tmp_path / "agent").mkdir()
    script = tmp_path / "agent" / "run.py"
    script.write_text(f"#!{python}\nprint('hi')\n")
    script.chmod(0o755)
    shown = command_paths([str(script), "{prompt}"], {"PATH": "/usr/bin"})
    assert set(shown) == {tmp_path / "agent", tmp_path / "venv", tmp_path / "python"}


def test_a_bare_name_is_shown_only_when_a_venv_on_the_path_holds_it(tmp_path):
    python = _venv(tmp_path)
    (tmp_path / "shims").mkdir()
    (tmp_path / "shims" / "python3").write_text("#!/bin/sh\n")
    (tmp_path / "shims" / "python3").chmod(0o755)
    assert command_paths(["python3", "x"], {"PATH": str(tmp_path / "shims")}) == []
    assert tmp_path / "venv" in command_paths(["python"], {"PATH": str(python.parent)})


def test_the_harness_folder_and_a_system_program(tmp_path):
    assert command_paths(["/bin/sh", "-c", "true"], {"LCAP_HARNESS_DIR": str(tmp_path)}) == [tmp_path]


def test_never_the_hosts_root_nor_a_system_folder_and_nested_paths_once(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert outside_system([Path("/"), Path("/usr/bin"), Path("/etc"), tmp_path / "a" / "b", tmp_path / "a"]) == [
        tmp_path / "a"
    ]


def test_etc_secrets_are_hidden_and_shares_get_enterable_parents(tmp_path):
    args = system_args()
    for secret in SECRETS:
        if os.path.lexists(secret):
            assert secret in args
    assert "/" not in [args[i + 1] for i, a in enumerate(args) if a == "--ro-bind"]
    share = tmp_path / "x"
    shared = share_args([share])
    assert shared[-3:] == ["--ro-bind", str(share), str(share)]
    assert ["--perms", "0755", "--dir", str(tmp_path)] == shared[-7:-3]
