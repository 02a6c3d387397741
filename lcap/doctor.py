"""`lcap doctor`'s registry: small checks, each a name, whether lcap needs it, and a function that says what it
found and, when something is wrong, what to do.

A stage adds its checks in its own `doctor.py` with the `check` decorator; the CLI imports those modules and
runs `run_checks`. A check only looks (it changes nothing a user owns), bounds every wait it makes, and reports
through a `Result`: `ok`, `warn` (worth knowing, never failing), `fail` (with a fix) or `skip` (not here, or a
check it needs did not pass). `lcap doctor` exits 0 only when no required check failed.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from rich.text import Text

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True)
class Result:
    """What a check found: `summary` is one line; `fix` says what to do when it is not ok."""

    status: Status
    summary: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @classmethod
    def ok(cls, summary: str, **details: Any) -> Result:
        return cls("ok", summary, details=details)

    @classmethod
    def warn(cls, summary: str, fix: str = "", **details: Any) -> Result:
        return cls("warn", summary, fix, details=details)

    @classmethod
    def fail(cls, summary: str, fix: str, **details: Any) -> Result:
        return cls("fail", summary, fix, details=details)

    @classmethod
    def skip(cls, summary: str, **details: Any) -> Result:
        return cls("skip", summary, details=details)


@dataclass
class Context:
    """What the checks of one `lcap doctor` run share: the store it was asked about, a scratch directory that
    goes at the end, what earlier checks found, and things worth making once (a local TLS server, ...)."""

    db: Path
    scratch: Path
    results: dict[str, Result] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    cleanup: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        """`make()`'s value, made on the first call of this run (a context manager is entered and closed at the end)."""
        if key not in self.shared:
            value = make()
            if isinstance(value, contextlib.AbstractContextManager):
                value = self.cleanup.enter_context(value)
            self.shared[key] = value
        return self.shared[key]


@dataclass(frozen=True)
class Check:
    name: str  # dotted: its first part is the group (`ca`, `trust`, `policy`, ...)
    section: str  # the stage that owns it, for the listing
    required: bool  # a failure makes `lcap doctor` exit 1
    run: Callable[[Context], Result]
    needs: tuple[str, ...] = ()  # checks that must pass (ok or warn) first; otherwise this one is skipped
    timeout: float = 60.0  # seconds; a check still running then is reported as failed


CHECKS: list[Check] = []


def check(
    name: str, *, section: str, required: bool, needs: Iterable[str] = (), timeout: float = 60.0
) -> Callable[[Callable[[Context], Result]], Callable[[Context], Result]]:
    """Register `run` as the check `name` (replacing one of that name: a module imported twice adds nothing)."""

    def register(run: Callable[[Context], Result]) -> Callable[[Context], Result]:
        entry = Check(name, section, required, run, tuple(needs), timeout)
        for i, existing in enumerate(CHECKS):
            if existing.name == name:
                CHECKS[i] = entry
                break
        else:
            CHECKS.append(entry)
        return run

    return register


def selected(patterns: Iterable[str] = ()) -> list[Check]:
    """The checks whose name is one of `patterns` or starts with one and a dot (all of them without patterns),
    with the checks they need, in registration order."""
    wanted = list(patterns)
    if not wanted:
        return list(CHECKS)
    names = {c.name for c in CHECKS if any(named_by(c.name, p) for p in wanted)}
    by_name = {c.name: c for c in CHECKS}
    todo = list(names)
    while todo:
        for need in by_name[todo.pop()].needs:
            if need in by_name and need not in names:
                names.add(need)
                todo.append(need)
    return [c for c in CHECKS if c.name in names]


@contextlib.contextmanager
def context(db: Path) -> Iterator[Context]:
    with tempfile.TemporaryDirectory(prefix="lcap-doctor-") as scratch:
        ctx = Context(db=Path(db), scratch=Path(scratch))
        with ctx.cleanup:
            yield ctx


def run_checks(
    ctx: Context, checks: Iterable[Check], on_result: Callable[[Check, Result], None] | None = None
) -> list[tuple[Check, Result]]:
    """Run `checks` in order; a check whose `needs` did not pass is skipped. A check that raises or outlives its
    timeout is a failure of that check, never of the run."""
    done = []
    for item in checks:
        blocked = [n for n in item.needs if ctx.results.get(n, Result.skip("")).status not in ("ok", "warn")]
        if blocked:
            result = Result.skip(f"needs {', '.join(blocked)}")
        else:
            result = _timed(item, ctx)
        ctx.results[item.name] = result
        done.append((item, result))
        if on_result is not None:
            on_result(item, result)
    return done


def _timed(item: Check, ctx: Context) -> Result:
    box: list[Result] = []
    started = time.monotonic()

    def body() -> None:
        try:
            box.append(item.run(ctx))
        except Exception as exc:  # a broken check says so and the others still run
            box.append(
                Result.fail(
                    f"the check itself failed: {exc.__class__.__name__}: {exc}",
                    "this is a bug in lcap's check: report it with this line",
                )
            )

    worker = threading.Thread(target=body, name=f"lcap-doctor-{item.name}", daemon=True)
    worker.start()
    worker.join(item.timeout)
    seconds = round(time.monotonic() - started, 3)
    if not box:
        return Result.fail(
            f"no answer within {item.timeout:g} s",
            "something it waits on hangs: run `lcap doctor " + item.name + "` again, or look at what it checks",
            seconds=seconds,
        )
    return replace(box[0], seconds=seconds)


def failed(results: Iterable[tuple[Check, Result]], *, required: bool) -> list[str]:
    return [c.name for c, r in results if r.status == "fail" and c.required == required]


def exit_code(results: Iterable[tuple[Check, Result]], named: Iterable[str] = ()) -> int:
    """0 when every required check passed (or did not apply here), else 1; an optional check the user named (or a
    section of it: `lcap doctor ray`) counts as required."""
    results = list(results)
    wanted = [p.strip() for p in named if p.strip()]
    asked = [c.name for c, r in results if r.status == "fail" and any(named_by(c.name, p) for p in wanted)]
    return 1 if failed(results, required=True) or asked else 0


def named_by(name: str, pattern: str) -> bool:
    """Whether `lcap doctor PATTERN` names the check `name`: itself, or a section of it (`transparent`)."""
    return name == pattern or name.startswith(pattern + ".")


def as_json(results: Iterable[tuple[Check, Result]]) -> dict[str, Any]:
    results = list(results)
    return {
        "ok": exit_code(results) == 0,
        "checks": [
            {
                "name": c.name,
                "section": c.section,
                "required": c.required,
                "status": r.status,
                "summary": r.summary,
                "fix": r.fix or None,
                "details": r.details,
                "seconds": r.seconds,
            }
            for c, r in results
        ],
    }


_MARKS = {"ok": ("ok", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "bold red"), "skip": ("skip", "dim")}


def line(item: Check, result: Result) -> Any:
    """One check as rich Text: its mark, name, what it found and, below, the fix. Text, never markup: summaries
    quote paths, server answers and error messages."""
    word, style = _MARKS[result.status]
    if result.status == "fail" and not item.required:
        word, style = "fail", "yellow"
    text = Text()
    text.append(f"  {word:<4}", style=style)
    text.append(f"  {item.name:<21}", style="bold" if result.status == "fail" else "")
    text.append(result.summary)
    if result.fix and result.status in ("fail", "warn"):
        text.append("\n" + " " * 29 + "fix: ", style=style)
        text.append(result.fix)
    return text


def verdict(results: list[tuple[Check, Result]]) -> str:
    required, optional = failed(results, required=True), failed(results, required=False)
    counts = {s: sum(1 for _, r in results if r.status == s) for s in ("ok", "warn", "fail", "skip")}
    tally = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    if required:
        head = f"{len(required)} required check{'s' if len(required) > 1 else ''} failed: {', '.join(required)}"
    else:
        head = "every required check passed"
    tail = f"; optional parts missing: {', '.join(optional)}" if optional else ""
    return f"{head}{tail} ({tally})"
