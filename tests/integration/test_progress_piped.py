"""Never silent when piped (lcap/progress.py): a command at work whose stderr is a pipe prints a line at its start,
at least every LCAP_PROGRESS_S (30 s; 0.1 s here) while a step lasts, and at its end. Each test runs the real
command in a subprocess with a stand-in for the slow part that cannot run here in seconds (npm, vLLM) and stamps
every line as it arrives."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

from fixtures_vllm import record_dead_server

BEAT = 0.1  # LCAP_PROGRESS_S in these tests
SLOW = 1.0  # how long each stand-in works in silence


def _stamped(argv: list[str], env: dict[str, str], timeout: float = 120) -> tuple[list[tuple[float, str]], str, int]:
    """Run `argv` with stderr piped: ([(seconds since start, line)], stdout, exit code)."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None and proc.stdout is not None
    lines = [(time.monotonic() - started, line.rstrip("\n")) for line in proc.stderr]
    out = proc.stdout.read()
    return lines, out, proc.wait(timeout=timeout)


def _silent_stand_in(folder: Path, name: str, said: str = "", code: int = 0) -> Path:
    """An executable that works in silence for SLOW seconds, then prints `said` and exits with `code`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\nsleep {SLOW}\n{'echo ' + repr(said) if said else ''}\nexit {code}\n")
    path.chmod(0o755)
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "LCAP_HOME": str(tmp_path / "home"), "LCAP_PROGRESS_S": str(BEAT), **extra}
    env.pop("COLUMNS", None)
    return env


def _beats(lines: list[tuple[float, str]], prefix: str) -> list[float]:
    return [t for t, line in lines if line.startswith(prefix)]


def test_setup_shows_each_step_and_a_silent_install_keeps_saying_it_works(tmp_path):
    """`lcap setup node` with an npm that works 1 s in silence: the step's start and end lines, and the install's
    lines at least every beat (with a 30 s beat, a silent npm of minutes would show one line)."""
    bin_dir = tmp_path / "bin"
    _silent_stand_in(bin_dir, "npm", said="added 2 packages in 1s")
    env = _env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    lines, out, code = _stamped([sys.executable, "-m", "lcap", "setup", "node"], env)
    said = [line for _, line in lines]
    assert code == 0, said
    assert said[0].startswith("lcap setup node: checking what is there") and said[-1].startswith(
        "lcap setup node: done"
    )
    beats = _beats(lines, "lcap: install the Node preload's packages: starting (")
    assert len(beats) >= 5, said  # the phase's line and its heartbeats, against 1 without them
    assert max(b - a for a, b in itertools.pairwise(beats)) < 10 * BEAT  # generous: a shared, loaded machine
    assert "lcap setup node: npm could not install" in out  # the stand-in installed nothing: the step says so


def test_a_deploy_that_restarts_vllm_is_never_silent(tmp_path, monkeypatch):
    """`lcap deploy --restart` of a checkpoint, with a "vLLM" that takes 1 s and then dies (twice: the checkpoint,
    then the previous policy): the deploy's own lines and vLLM's start, a line at least every beat, and the one-line
    error at the end."""
    from lcap.policy import read_policy, write_policy

    stand_in = _silent_stand_in(tmp_path / "bin", "python", code=1)
    record = tmp_path / "policy.json"
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(record))
    env = _env(tmp_path, LCAP_POLICY_RECORD=str(record))
    gone = subprocess.Popen(["true"])  # the running "vLLM": gone already, so the restart has nothing to stop
    gone.wait()
    record_dead_server(pid=gone.pid)
    policy = read_policy()
    assert policy is not None
    policy.python = str(stand_in)
    write_policy(policy)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    argv = [sys.executable, "-m", "lcap", "deploy", str(checkpoint), "--restart", "--name", "m2"]
    lines, _, code = _stamped(argv + ["--drain-timeout", "5"], env)
    said = [line for _, line in lines]
    assert code == 2 and any(line.startswith("lcap: checkpoint") and "did not start" in line for line in said), said
    assert any(line.startswith("deploy: restarting the replica on ") for line in said), said
    starts = _beats(lines, "starting vLLM")
    assert len(starts) >= 8, said  # two starts of 1 s each, a line a beat
    times = [t for t, line in lines if line.startswith(("deploy", "starting vLLM"))]
    assert max(b - a for a, b in itertools.pairwise(times)) < 10 * BEAT
