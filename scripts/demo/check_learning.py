"""Check the demo's learning claim from what `lcap demo` wrote: held-out reward +0.3 within 5 rounds, <= 15 min.

    python scripts/demo/check_learning.py [OUT]      # OUT defaults to ./lcap-demo

Prints the per-round table and PASS/FAIL; exits 1 on FAIL.
"""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else "lcap-demo")
results = json.loads((out / "results.json").read_text())
rows = results["rounds"]
fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
for r in rows:
    print(
        f"round {r['round']}: held-out {fmt(r['eval_reward'])} (well-formed {fmt(r.get('eval_well_formed'), 2)}, "
        f"right {fmt(r.get('eval_right'), 2)})  train {fmt(r['train_reward'])}"
    )
evals = [(r["round"], r["eval_reward"]) for r in rows if r["eval_reward"] is not None]
base = evals[0][1]
within = [v for n, v in evals[1:] if n <= 5]
gain = max(within) - base if within else 0.0
minutes = results["seconds"] / 60
ok = gain >= 0.3 and minutes <= 15
print(
    f"held-out mean reward: base {base:.3f}, best within 5 rounds {base + gain:.3f} (+{gain:.3f}); "
    f"total {minutes:.1f} min -> {'PASS' if ok else 'FAIL'} (needs +0.300 and <= 15 min)"
)
sys.exit(0 if ok else 1)
