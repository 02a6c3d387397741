"""Runs a verifier's command so that nothing it started outlives it: `python -I reaper.py ARGV...`.

A process group ends a verifier's children, but not one that left the group (`setsid`, a daemon's double fork).
This wrapper makes itself their child subreaper (Linux `PR_SET_CHILD_SUBREAPER`): whatever the command starts and
orphans is reparented here, not to init, and is killed when the command ends or when the wrapper is told to stop
(SIGTERM, at the verifier's timeout). Its exit status is the command's. Run as a file, not a module, so that it
imports nothing of lcap's (it starts once per verifier).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def _children() -> list[int]:
    """This process's children, from /proc (its own task's children file lists only the main thread's)."""
    found = []
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if fields[1].decode() == me:
                found.append(int(entry))
    return found


def _reap_all() -> None:
    """Kill every descendant left (each orphan comes here), until none is."""
    while children := _children():
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def main() -> int:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("lcap: cannot become a child subreaper", file=sys.stderr)
        return 125
    try:
        command = subprocess.Popen(sys.argv[1:])
    except OSError as exc:
        print(f"lcap: cannot run verifier {sys.argv[1]}: {exc.strerror or exc}", file=sys.stderr)
        return 127

    def stop(signum: int, _frame: object) -> None:
        _reap_all()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    code = command.wait()
    _reap_all()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
