"""Progress for every long command: a rich bar on a terminal, elsewhere a plain line at least every HEARTBEAT_S.

A person never waits in silence: at a terminal the bar shows what is done, what it is doing now (`describe()`,
the command's own words: episodes ok/failed/running, calls, reward, step and loss), the time taken and, when the
total is known, the time left. When stderr is a file or a pipe (a CI log, `nohup`, a Kubernetes job) there is no
bar; a line with the same figures is printed when the work starts, every HEARTBEAT_S seconds while it runs (a
timer, so a step that takes minutes still shows it is alive) and when it ends. Lines printed through `print` go
above the bar, or straight to the log. A wait with nothing to count (a deploy, vLLM's start, an install) is a
Reporter with `counted=False`: a spinner at a terminal, its words and time elsewhere.

LCAP_PROGRESS_S sets the seconds between those lines (default HEARTBEAT_S; a CI log may want fewer, a test more).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from lcap.config import LcapError

HEARTBEAT_S = 30.0  # the longest a log goes without a line from a command at work
INTERVAL_VARIABLE = "LCAP_PROGRESS_S"
# Every Reporter's stderr: one Console, so that a wait inside a wait (vLLM's start in a deploy) nests its bar in the
# outer one's display instead of drawing over it.
STDERR = Console(stderr=True)


def heartbeat_s() -> float:
    """The seconds between progress lines off a terminal: LCAP_PROGRESS_S, else HEARTBEAT_S."""
    said = os.environ.get(INTERVAL_VARIABLE)
    if not said:
        return HEARTBEAT_S
    try:
        seconds = float(said)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds <= HEARTBEAT_S:
        raise LcapError(f"{INTERVAL_VARIABLE}={said}: give seconds between progress lines, above 0 and at most 30")
    return seconds


class Reporter:
    """One piece of long work: `advance` as units finish, `refresh` when `describe()` has news, `print` a line."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        describe: Callable[[], str] | None = None,
        *,
        show: bool | None = None,
        console: Console | None = None,
        heartbeat: float | None = None,
        counted: bool = True,
        doing: str = "",
    ) -> None:
        """`show`: the bar (a terminal) or plain lines (None: whichever stderr is); `heartbeat`: seconds between
        lines (None: `heartbeat_s()`); `counted`: False for a wait that has no units, only words and its time.
        Without `describe` the words are `doing`, then the last `step`'s."""
        self.label, self.total, self.counted = label, total, counted
        self.doing = doing
        self.describe = describe or (lambda: self.doing)
        self.console = console or STDERR
        self.bar = show if show is not None else self.console.is_terminal
        self.heartbeat = heartbeat if heartbeat is not None else heartbeat_s()
        self.done = 0
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._timer: threading.Thread | None = None
        self._progress: Progress | None = None
        self._job: Any = None

    def __enter__(self) -> Reporter:
        self._started = time.monotonic()
        if self.bar:
            # Plain text, as the lines off a terminal: the words may quote a log or an agent ("[/path]" as markup
            # would stop the bar with an error).
            columns: list[Any] = [TextColumn(self.label, markup=False)]
            columns += [BarColumn(), MofNCompleteColumn()] if self.counted else [SpinnerColumn()]
            columns += [TextColumn("{task.description}", markup=False), TimeElapsedColumn()]
            if self.total is not None:
                columns.append(TimeRemainingColumn())
            self._progress = Progress(*columns, console=self.console, transient=False)
            self._progress.__enter__()
            self._job = self._progress.add_task(self.describe(), total=self.total)
        else:
            self._line()
            self._timer = threading.Thread(target=self._beat, name=f"lcap-progress-{self.label}", daemon=True)
            self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._progress is not None:
            self.refresh()  # the bar stays on the screen: with its last words
            self._progress.__exit__(*exc)
        else:
            if self._timer is not None:
                self._timer.join(5)
            self._line()

    def advance(self, units: int = 1) -> None:
        with self._lock:
            self.done += units
        if self._progress is not None:
            self._progress.update(self._job, advance=units, description=self.describe())

    def refresh(self) -> None:
        if self._progress is not None:
            self._progress.update(self._job, description=self.describe())

    def step(self, doing: str) -> None:
        """The work moved on to `doing` (what `describe` says when none was given): a line at once off a terminal."""
        self.doing = doing
        if self._timer is not None or self._progress is not None:  # before the start, the start's line says it
            self.say()

    def say(self) -> None:
        """News worth a line now (a wait's next phase): off a terminal the line comes at once, on it the bar shows it."""
        if self._progress is not None:
            self.refresh()
        else:
            self._line()

    def print(self, *renderables: Any, **kwargs: Any) -> None:
        self.console.print(*renderables, **kwargs)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self._started
        with self._lock:
            done = self.done
        count = (f"{done}/{self.total}" if self.total is not None else str(done)) if self.counted else ""
        said = ", ".join(part for part in (count, self.describe()) if part)
        self.console.print(
            f"{self.label}: {said} ({_clock(elapsed)})" if said else f"{self.label} ({_clock(elapsed)})",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        self.console.file.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"
