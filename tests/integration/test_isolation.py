"""lcap's own Python processes import nothing from the directory the agent works in.

`python -m X` puts the current directory first on sys.path: an agent that writes `lcap.py`, `duckdb.py`
or `secrets.py` where it works would otherwise run its code in lcap's writer (outside any sandbox, with
write access to the store). Each shadowing module here writes a marker file if imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fixtures_capture import agent, run_lcap, turns

from lcap.processes import helper_env
from lcap.serve.vllm_env import imports_vllm

SHADOWS = ("lcap", "duckdb", "pyarrow", "json", "select", "secrets", "cryptography", "vllm", "shadowed")


def _plant(directory: Path, marker: Path) -> None:
    for name in SHADOWS:
        (directory / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'a').write({name!r} + ' imported\\n')\n", encoding="utf-8"
        )


def test_the_writer_imports_nothing_from_the_agents_directory(capture_env, llm, tmp_path):
    workdir, marker = tmp_path / "work", tmp_path / "marker"
    workdir.mkdir()
    _plant(workdir, marker)
    result = run_lcap(
        ["proxy", "--upstream", llm.url, "--", *agent("openai_agent.py"), "chat"], capture_env, cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    assert len(turns(capture_env["LCAP_DB"])) == 1  # the writer ran, and stored the turn
    assert not marker.exists(), marker.read_text()


def test_helpers_and_their_children_ignore_the_current_directory(tmp_path):
    """vLLM's import check (a `vllm.py` where lcap runs would pass it) and the children of accelerate, which
    start Pythons without -I: `helper_env` isolates them through PYTHONSAFEPATH."""
    marker = tmp_path / "marker"
    _plant(tmp_path, marker)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert not imports_vllm(sys.executable)  # the project's venv has no vllm; cwd/vllm.py must not count
    finally:
        os.chdir(cwd)
    child = subprocess.run(
        [sys.executable, "-c", "import shadowed"], cwd=tmp_path, env=helper_env(os.environ), capture_output=True
    )
    assert child.returncode != 0 and b"No module named 'shadowed'" in child.stderr
    assert not marker.exists(), marker.read_text()
    plain = subprocess.run([sys.executable, "-c", "import shadowed"], cwd=tmp_path, capture_output=True)
    assert plain.returncode == 0 and marker.read_text() == "shadowed imported\n"  # the test's shadow does work
