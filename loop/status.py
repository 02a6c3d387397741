"""`lcap status`'s section of the loop: the last step `lcap loop` finished (`loop_steps`), per run, in the store
asked about and in the store of every loop running now (each says where it writes: `running_loop`)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from lcap.config import LcapError, lcap_home
from lcap.display import num
from lcap.processes import alive
from lcap.status import STORE_TIMEOUT, Section, View, age, section
from lcap.store import Store, table_names

RUNS = 3  # runs shown, the most recent first

# Per run, its last step and the last held-out reward it measured (an eval step's: a deploy's or collect's own
# figure is no held-out one). A round skipped with nothing to learn is the step `skipped`, its reason in details; a
# candidate refused on held-out evidence is the step `promote` with `promoted` false and its reason.
_LAST_STEPS = f"""
SELECT run, arg_max(round, created_at), arg_max(step, created_at),
       arg_max(mean_reward, created_at) FILTER (WHERE step = 'eval' AND mean_reward IS NOT NULL),
       epoch(max(created_at)), arg_max(details, created_at)
FROM loop_steps GROUP BY run ORDER BY max(created_at) DESC LIMIT {RUNS}
"""


def _records() -> Path:
    return lcap_home() / "loops"


@contextlib.contextmanager
def running_loop(db: Path, run: Path) -> Iterator[None]:
    """While an `lcap loop` runs: $LCAP_HOME/loops/PID.json names its store and run, so `lcap status` finds them
    whatever --db the loop was given."""
    folder = _records()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{os.getpid()}.json"
    path.write_text(json.dumps({"pid": os.getpid(), "db": str(Path(db).resolve()), "run": str(Path(run).resolve())}))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def running_stores() -> list[Path]:
    """The stores of the loops running now (a record whose process ended is skipped)."""
    stores: list[Path] = []
    folder = _records()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            running = alive(int(record["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if running and Path(record["db"]) not in stores:
            stores.append(Path(record["db"]))
    return stores


@section("loop")
def loop(view: View) -> Section:
    s = Section(
        "loop runs",
        ["run", "last step", "round", "held-out reward", "finished"],
        empty="no `lcap loop` step in this store",
    )
    asked = view.db.resolve()
    rows = []
    for db in [asked, *(d for d in running_stores() if d != asked)]:
        if not db.exists():
            continue
        try:
            with Store(db, timeout=STORE_TIMEOUT).connect(read_only=True) as con:
                rows += con.execute(_LAST_STEPS).fetchall() if "loop_steps" in table_names(con) else []
        except LcapError as exc:
            s.notes.append(f"store {db} not readable now ({exc})")
        if db != asked:
            s.notes.append(f"a running loop writes to {db} (--db)")
    data = []
    for run, round_, step, reward, finished, details in sorted(rows, key=lambda r: -r[4])[:RUNS]:
        info = json.loads(details) if details else None
        shown = step
        skipped = step.split(":")[0] == "skipped"  # a round's, or one role's of --per-role (`skipped:ROLE`)
        if isinstance(info, dict) and (skipped or (step == "promote" and info.get("promoted") is False)):
            shown = f"{step if skipped else 'refused'}: {info.get('reason')}"
        s.rows.append([run, shown, str(round_), num(reward), f"{age(view.now - finished)} ago"])
        data.append(
            {
                "run": run,
                "round": round_,
                "step": step,
                "held_out_reward": reward,
                "finished_at": finished,
                "details": info,
            }
        )
    s.data = data
    return s
