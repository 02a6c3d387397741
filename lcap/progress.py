"""Progress for every long command: a rich bar on a terminal, elsewhere a plain line at least every HEARTBEAT_S.

A person never waits in silence: at a terminal the bar shows what is done, what it is doing now (`describe()`,
the command's own words: episodes ok/failed/running, calls, reward, step and loss), the time taken and, when the
total is known, the time left. When stderr is a file or a pipe (a CI log, `nohup`, a Kubernetes job) there is no
bar; a line with the same figures is printed when the work starts, every HEARTBEAT_S seconds while it runs (a
timer, so a step that takes minutes still shows it is alive) and when it ends. Lines printed through `print` go
above the bar, or straight to the log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

HEARTBEAT_S = 30.0  # the longest a log goes without a line from a command at work


class Reporter:
    """One piece of long work: `advance` as units finish, `refresh` when `describe()` has news, `print` a line."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        describe: Callable[[], str] = lambda: "",
        *,
        show: bool | None = None,
        console: Console | None = None,
        heartbeat: float = HEARTBEAT_S,
    ) -> None:
        """`show`: the bar (a terminal) or plain lines (None: whichever stderr is)."""
        self.label, self.total, self.describe = label, total, describe
        self.console = console or Console(stderr=True)
        self.bar = show if show is not None else self.console.is_terminal
        self.heartbeat = heartbeat
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
            columns: list[Any] = [TextColumn(self.label), BarColumn(), MofNCompleteColumn()]
            columns += [TextColumn("{task.description}"), TimeElapsedColumn()]
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

    def print(self, *renderables: Any, **kwargs: Any) -> None:
        self.console.print(*renderables, **kwargs)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self._started
        with self._lock:
            done = self.done
        count = f"{done}/{self.total}" if self.total is not None else str(done)
        said = self.describe()
        self.console.print(
            f"{self.label}: {count}{', ' + said if said else ''} ({_clock(elapsed)})",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        self.console.file.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"
