"""`lcap status`'s section of the loop: the last step `lcap loop` finished in the store (`loop_steps`), per run."""

from __future__ import annotations

import json

from lcap.config import LcapError
from lcap.display import num
from lcap.status import STORE_TIMEOUT, Section, View, age, section
from lcap.store import Store, table_names

RUNS = 3  # runs shown, the most recent first

# Per run, its last step and the last held-out reward it measured (an eval step's: a deploy's or collect's own
# figure is no held-out one). A round skipped with nothing to learn is the step `skipped`, its reason in details.
_LAST_STEPS = f"""
SELECT run, arg_max(round, created_at), arg_max(step, created_at),
       arg_max(mean_reward, created_at) FILTER (WHERE step = 'eval' AND mean_reward IS NOT NULL),
       epoch(max(created_at)), arg_max(details, created_at)
FROM loop_steps GROUP BY run ORDER BY max(created_at) DESC LIMIT {RUNS}
"""


@section("loop")
def loop(view: View) -> Section:
    s = Section(
        "loop runs",
        ["run", "last step", "round", "held-out reward", "finished"],
        empty="no `lcap loop` step in this store",
    )
    if not view.db.exists():
        return s
    try:
        with Store(view.db, timeout=STORE_TIMEOUT).connect(read_only=True) as con:
            rows = con.execute(_LAST_STEPS).fetchall() if "loop_steps" in table_names(con) else []
    except LcapError as exc:
        s.empty = f"store not readable now ({exc})"
        return s
    data = []
    for run, round_, step, reward, finished, details in rows:
        info = json.loads(details) if details else None
        shown = f"skipped: {info.get('reason')}" if step == "skipped" and isinstance(info, dict) else step
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
