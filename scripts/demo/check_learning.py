"""Check the demo's learning targets on what `lcap demo` stored, and print PASS or FAIL.

    .venv/bin/python scripts/demo/check_learning.py [OUT]      # OUT defaults to ./lcap-demo

Reads the held-out episodes of every round from OUT/lcap.duckdb (their rewards and the verifier's
well-formed / right details), prints one line per round (with, for a multi-call agent such as
`lcap demo --task tools`, the training episodes' calls, the share of later calls stitched and samples
per episode; for the tools task, how often the first call looked the words up and how often those episodes
were right; for the roles task, each role's success), then checks the targets at the last round: for the tiny model, held-out mean reward >= 0.8,
held-out right answers >= 0.6, and neither fell by more than 0.1 from the round before; for a pretrained model
(`lcap demo --model smollm2`), held-out right answers >= the base's (round 0) + 0.25 and at most 0.05 below the
best round's (the targets are defined once, in lcap.loop.demo.runner). Exits 1 on FAIL.
"""

import json
import sys
from pathlib import Path

from lcap.loop.demo.runner import calls_by_round, check_targets, demo_task, held_out_by_round
from lcap.loop.demo.tools import lookups_by_round
from lcap.store import Store

out = Path(sys.argv[1] if len(sys.argv) > 1 else "lcap-demo")
store = Store(out / "lcap.duckdb")
held_out = held_out_by_round(store)
calls = {c["round"]: c for c in calls_by_round(store)}
settings = out / "demo.json"
task = json.loads(settings.read_text()).get("task") if settings.exists() else None
tools = task == "tools"
pretrained = task is not None and demo_task(task).model != "tiny"
lookups = lookups_by_round(store) if tools else {}
for h in held_out:
    c = calls.get(h["round"])
    multi = (
        f"; training: {c['calls']:.1f} calls/episode, {c['stitched'] or 0:.2f} of later calls stitched, "
        f"{c['samples'] or 0:.2f} samples/episode"
        if c and c["calls"] > 1
        else ""
    )
    lookup = lookups.get(h["round"])
    looked = (
        f", first call looked the words up {lookup['looked_up']:.2f} (right among them "
        f"{lookup['right_when_looked_up'] or 0:.2f}; of the others {lookup['later'] or 0:.2f} later; right when "
        f"never {lookup['right_when_never'] or 0:.2f}; a tool call the parser could not read {lookup['broken']:.2f})"
        if lookup
        else ""
    )
    print(
        f"round {h['round']}: held-out reward {h['reward']:.3f}, well-formed {h['well_formed']:.2f}, "
        f"right {h['right']:.2f}{looked} ({h['episodes']} episodes){multi}"
    )
if task is not None and (report := demo_task(task).report):  # the roles task: success per role
    print(report(store)["line"].removeprefix("[demo] "))
results = out / "results.json"
if results.exists():
    print(f"total {json.loads(results.read_text())['seconds'] / 60:.1f} min (results.json)")
passed, verdicts = check_targets(held_out, pretrained=pretrained)
print("\n".join(verdicts))
print("PASS" if passed else "FAIL")
sys.exit(0 if passed else 1)
