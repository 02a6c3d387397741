"""Check the demo's learning targets on what `lcap demo` stored, and print PASS or FAIL.

    .venv/bin/python scripts/demo/check_learning.py [OUT]      # OUT defaults to ./lcap-demo

Reads the held-out episodes of every round from OUT/lcap.duckdb (their rewards and the verifier's
well-formed / right details), prints one line per round, then checks, at the last round: held-out mean
reward >= 0.8, held-out right answers >= 0.6, and neither fell by more than 0.1 from the round before
(the targets are defined once, in lcap.loop.demo). Exits 1 on FAIL.
"""

import json
import sys
from pathlib import Path

from lcap.loop.demo import check_targets, held_out_by_round
from lcap.store import Store

out = Path(sys.argv[1] if len(sys.argv) > 1 else "lcap-demo")
held_out = held_out_by_round(Store(out / "lcap.duckdb"))
for h in held_out:
    print(
        f"round {h['round']}: held-out reward {h['reward']:.3f}, well-formed {h['well_formed']:.2f}, "
        f"right {h['right']:.2f} ({h['episodes']} episodes)"
    )
results = out / "results.json"
if results.exists():
    print(f"total {json.loads(results.read_text())['seconds'] / 60:.1f} min (results.json)")
passed, verdicts = check_targets(held_out)
print("\n".join(verdicts))
print("PASS" if passed else "FAIL")
sys.exit(0 if passed else 1)
