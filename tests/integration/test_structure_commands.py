"""Each stage's commands load in a fresh interpreter without the CLI module (the import rules themselves:
tests/unit/test_structure.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

STAGES = ("capture", "dataset", "train", "serve", "loop", "ui")


@pytest.mark.parametrize("stage", STAGES)
def test_each_stages_commands_import_on_their_own(stage):
    """A stage's commands load without the CLI module (they take shared options from lcap.cli_options)."""
    code = (
        f"import sys, typer; import lcap.{stage}.commands as c; from lcap.cli_stages import StageRegistry; "
        "c.register(StageRegistry(typer.Typer())); "
        "assert 'lcap.cli' not in sys.modules, 'lcap.cli was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_cli_starts_without_numpy_or_pyarrow():
    """Every `lcap` command pays the CLI's imports: numpy and pyarrow (a module-level import of the dataset builder
    brought them, 40% of the start-up's CPU) load only inside the commands that use them."""
    code = (
        "import sys; sys.argv = ['lcap', 'sql', 'SELECT 1']; import lcap.cli; "
        "heavy = sorted({'numpy', 'pyarrow'} & set(sys.modules)); assert not heavy, heavy"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
