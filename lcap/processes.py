"""Child processes: the agent lcap runs (in the foreground, or in a process group of its own) and the servers it
starts. One runner and one way to end a process group, for every stage."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from lcap.config import LcapError

TIMEOUT_EXIT = 124  # the exit code of a child ended by its timeout, as timeout(1) reports it


@dataclass
class ChildExit:
    code: int  # the child's exit code; 128+N when signal N killed it; TIMEOUT_EXIT on timeout
    timed_out: bool = False
    signals: list[int] = field(default_factory=list)  # SIGINT/SIGTERM/SIGHUP lcap received and passed on


def python_helper(python: str, *args: str) -> list[str]:
    """argv of a Python helper lcap starts (its turn writer, vLLM, accelerate, pip): isolated (`-I`: neither
    the current directory, nor PYTHONPATH, nor the user site is on sys.path), so that nothing an agent wrote
    where it works (a `secrets.py`, an `lcap/`) is imported by lcap's own processes."""
    return [python, "-I", *args]


def helper_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a helper whose own children are Pythons started without `-I` (accelerate's workers,
    torchrun's): the same isolation through variables they read (`PYTHONSAFEPATH`, Python 3.11+)."""
    out = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    out.update(PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1")
    return out


def run_child(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
    own_group: bool = False,
    stdin: int | IO | None = None,
    stdout: int | IO | None = None,
    stderr: int | IO | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    pass_fds: Sequence[int] = (),
) -> ChildExit:
    """Run `argv` until it exits; stdio is passed through unless given.

    In the foreground (`own_group=False`, `lcap proxy -- CMD`) the child shares lcap's terminal: SIGINT,
    SIGTERM and SIGHUP sent to lcap reach it (a Ctrl-C at a terminal already reaches the whole foreground
    group, so it is not sent twice), and lcap keeps running until it exits, so the caller can flush. With
    `own_group=True` (collect's episodes) it leads a process group of its own, and its timeout, or the end
    of it, ends every process it left in that group. A timeout ends the child with SIGTERM, then SIGKILL.
    Signal handlers are installed from the main thread only. An argv that cannot start is an LcapError.
    `pass_fds` are the open files the child inherits (capture's namespace set-up talks to lcap over one).
    """
    if not argv:
        raise LcapError("no command to run (put it after --)")
    try:
        child = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=own_group,
            pass_fds=tuple(pass_fds),
        )
    except OSError as exc:
        raise LcapError(f"cannot run {shlex.join(argv)}: {exc.strerror or exc}") from None
    if on_start is not None:
        on_start(child)
    result = ChildExit(code=0)

    def forward(signum: int, _frame: object) -> None:
        result.signals.append(signum)
        if signum == signal.SIGINT and _terminal_sent_it():
            return
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {}
    if not own_group and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, forward)
    try:
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            result.timed_out, result.code = True, TIMEOUT_EXIT
            if own_group:
                kill_group(child.pid, grace=5.0)
            else:
                _end(child)
            return result
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if own_group:
        kill_group(child.pid, grace=0)  # what the child left running in its group
    result.code = 128 - code if code < 0 else code
    return result


def kill_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM the process group `pgid` leads, then SIGKILL what is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive(pgid) and not group_alive(pgid):
                return
            time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie child of this process counts as dead: it is reaped here)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _end(child: subprocess.Popen) -> None:
    child.terminate()
    try:
        child.wait(5)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _terminal_sent_it() -> bool:
    """True when lcap is in the foreground of a terminal: its SIGINT went to the child too."""
    try:
        return sys.stdin.isatty() and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except OSError:
        return False
