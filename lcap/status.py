"""`lcap status`'s registry: what runs on this machine for this LCAP_HOME, section by section.

Each stage adds a section in its own `status.py` with the `section` decorator: a function that reads what its
processes announce (records and spools under LCAP_HOME, the policy record, the store) within a bound and returns
a `Section`: rows to show and data for `--json`. The CLI imports those modules, takes a `snapshot` and renders it
once, or again every interval with `--watch`. Nothing here listens on the network.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from lcap.config import LcapError
from lcap.store import Store, table_names

STORE_TIMEOUT = 2.0  # seconds a section waits for a store a writer holds


@dataclass
class Section:
    title: str
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    data: Any = None  # what --json prints for it
    empty: str = "none"  # said when there is no row
    wrap: tuple[str, ...] = ()  # columns that may wrap (long paths, commands); the others stay on one line
    notes: list[str] = field(default_factory=list)  # lines below the table


@dataclass(frozen=True)
class View:
    """What a snapshot is taken for: the store asked about (--db) and when (for ages)."""

    db: Path
    now: float


SECTIONS: list[tuple[str, Callable[[View], Section]]] = []


def section(name: str) -> Callable[[Callable[[View], Section]], Callable[[View], Section]]:
    """Register `gather` as the section `name` (replacing one of that name)."""

    def register(gather: Callable[[View], Section]) -> Callable[[View], Section]:
        SECTIONS[:] = [(n, g) for n, g in SECTIONS if n != name] + [(name, gather)]
        return gather

    return register


def snapshot(db: Path, order: tuple[str, ...] = ()) -> list[tuple[str, Section]]:
    """Every section now; one that fails says so in its place."""
    view = View(Path(db), time.time())
    ranked = sorted(SECTIONS, key=lambda s: order.index(s[0]) if s[0] in order else len(order))
    out = []
    for name, gather in ranked:
        try:
            out.append((name, gather(view)))
        except Exception as exc:  # one unreadable part never hides the others
            out.append((name, Section(name, notes=[f"could not read: {exc.__class__.__name__}: {exc}"])))
    return out


def as_json(sections: list[tuple[str, Section]]) -> dict[str, Any]:
    """Each section's data under its name, and what the notes say under `notes`."""
    out: dict[str, Any] = {name: s.data for name, s in sections}
    out["notes"] = {name: s.notes for name, s in sections if s.notes}
    return out


def render(sections: list[tuple[str, Section]]) -> Any:
    """The snapshot as rich renderables. Every value is Text, never markup: commands and errors are shown as
    they are."""
    parts: list[Any] = []
    for _, s in sections:
        if not s.rows:
            head = Text(f"{s.title}: ", style="bold")
            head.append(s.empty, style="dim")
            parts.append(head)
        else:
            table = Table(title=Text(s.title, style="bold"), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
            for column in s.columns:
                wraps = column in s.wrap
                table.add_column(column, no_wrap=not wraps, overflow="fold" if wraps else "ellipsis")
            for row in s.rows:
                table.add_row(*(Text(value) for value in row))
            parts.append(table)
        parts.extend(Text("  " + note, style="yellow") for note in s.notes)
    return Group(*parts)


def age(seconds: float | None) -> str:
    """A duration as people read it: 42s, 7m, 3h, 2d."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def size(n: float) -> str:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


@section("store")
def store_section(view: View) -> Section:
    """The store asked about: episodes running, turns, the last turn."""
    s = Section(f"store {view.db}", ["episodes running", "episodes", "turns", "last turn"])
    if not view.db.exists():
        s.empty = "does not exist yet"
        s.data = {"path": str(view.db), "exists": False}
        return s
    try:
        with Store(view.db, timeout=STORE_TIMEOUT).connect(read_only=True) as con:
            if not {"episodes", "turns"} <= table_names(con):
                s.empty = "not an lcap store yet (no episodes or turns table)"
                return s
            row = con.execute(
                """SELECT (SELECT count(*) FILTER (WHERE status = 'running') FROM episodes),
                          (SELECT count(*) FROM episodes), (SELECT count(*) FROM turns),
                          (SELECT epoch(max(ended_at)) FROM turns)"""
            ).fetchone()
    except LcapError as exc:
        s.empty = f"not readable now ({exc})"
        s.data = {"path": str(view.db), "error": str(exc)}
        return s
    assert row is not None
    running, episodes, turns, last = row
    s.rows = [[str(running), str(episodes), str(turns), f"{age(view.now - last)} ago" if last else "-"]]
    s.data = {
        "path": str(view.db),
        "episodes_running": running,
        "episodes": episodes,
        "turns": turns,
        "last_turn": last,
    }
    return s
