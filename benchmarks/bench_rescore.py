"""`lcap rescore` at scale (issue #37 requirement 3): 10k stored episodes scored in parallel, a crash, a resume.

    .venv/bin/python benchmarks/bench_rescore.py [--episodes 10000] [--judge-ms 20] [--concurrency 16]
        [--kill-after 0.4] [--out DIR]

A DuckDB store of `--episodes` one-call sessions (as `lcap proxy --serve` stores them: a `running` episode
labelled with its session, one chat turn) and a judge verifier (`judge.py:verify`: it waits `--judge-ms`, as a
call to a judge model would, and gives 1 when the answer is the one its task wants). Three measurements, each by
the real CLI in a subprocess:

1. **parallel**: the same `--sample` episodes scored at `--concurrency 1` and at `--concurrency`, each into a
   source of its own: episodes per second of each (the command's own timing, start-up left out) and the ratio.
2. **crash**: `lcap rescore --where true` over every episode, SIGKILLed once `--kill-after` of the time the
   parallel run predicts for them has passed; then the same command run again to its end.
3. **checks** read from the store: every episode has exactly one reward of the source, with the judge's value;
   the rerun skipped as many as the killed run had stored, and scored the rest.

Prints one JSON object; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lcap.store import Store

LCAP = str(Path(sys.executable).parent / "lcap")
JUDGE = """
import time

def verify(ctx):
    time.sleep({seconds})
    said = ctx.transcript["messages"][-1]["content"]
    return 1.0 if said == "Paris" else 0.0
"""
_SESSIONS = """
INSERT INTO episodes (episode_id, status, labels, started_at)
SELECT 's-' || i, 'running', json_object('session', 'sim-' || i, 'attributed_by', 'header'), now()
FROM range($n) t(i)
"""
_TURNS = """
INSERT INTO turns (turn_id, episode_id, seq, dialect, status_code, request, completion_text, finish_reason,
                   started_at, ended_at)
SELECT 's-' || i || '/0', 's-' || i, 0, 'chat', 200,
       '{"model": "m", "messages": [{"role": "user", "content": "The capital of France?"}]}',
       CASE WHEN i % 3 = 0 THEN 'Lyon' ELSE 'Paris' END, 'stop', now(), now()
FROM range($n) t(i)
"""
_LINE = re.compile(r"(\d+) episodes chosen, (\d+) scored before \(skipped\), (\d+) scored, (\d+) failed.*\[([\d.]+)s\]")


def rescore(db: Path, judge: Path, *, where: str, source: str, concurrency: int) -> list[str]:
    judged = ["--verifier", f"{judge}:verify", "--where", where, "--source", source]
    return [LCAP, "rescore", "--db", str(db), *judged, "--concurrency", str(concurrency)]


def run(argv: list[str]) -> tuple[float, dict[str, float]]:
    """(the command's wall seconds, its summary line's counts and `seconds`: the scoring, without start-up)."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    took = time.perf_counter() - t0
    found = _LINE.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    keys = ("chosen", "skipped", "scored", "failed", "seconds")
    return took, dict(zip(keys, [*map(int, found.groups()[:4]), float(found.group(5))], strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--sample", type=int, default=400, help="episodes of the parallel measurement")
    ap.add_argument("--judge-ms", type=float, default=20.0, help="milliseconds the judge takes per episode")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kill-after", type=float, default=0.4, help="share of the predicted run time before SIGKILL")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="lcap-bench-rescore-"))
    out.mkdir(parents=True, exist_ok=True)
    db = out / "lcap.duckdb"
    db.unlink(missing_ok=True)
    judge = out / "judge.py"
    judge.write_text(JUDGE.format(seconds=args.judge_ms / 1000))
    store = Store(db)
    t0 = time.perf_counter()
    store.execute(_SESSIONS, {"n": args.episodes})
    store.execute(_TURNS, {"n": args.episodes})
    report: dict = {"episodes": args.episodes, "judge_ms": args.judge_ms, "store_s": round(time.perf_counter() - t0, 1)}

    sample = f"episode_id IN (SELECT 's-' || i FROM range({args.sample}) t(i))"
    _, serial = run(rescore(db, judge, where=sample, source="serial", concurrency=1))
    wall, parallel = run(rescore(db, judge, where=sample, source="parallel", concurrency=args.concurrency))
    one, many = serial["seconds"], parallel["seconds"]
    report["parallel"] = {
        "episodes": args.sample,
        "per_s at concurrency 1": round(args.sample / one, 1),
        f"per_s at concurrency {args.concurrency}": round(args.sample / many, 1),
        "ratio": round(one / many, 2),
    }

    argv = rescore(db, judge, where="true", source="judge", concurrency=args.concurrency)
    kill_at = (wall - many) + args.kill_after * many * args.episodes / args.sample  # start-up, then a share
    killed = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(kill_at)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    before = store.fetchall("SELECT count(*) FROM rewards WHERE source = 'judge'")[0][0]
    took, rerun = run(argv)
    ((rewards, episodes, wrong),) = store.fetchall(
        "SELECT count(*), count(DISTINCT episode_id), "
        "count(*) FILTER (WHERE value <> CASE WHEN split_part(episode_id, '-', 2)::INT % 3 = 0 THEN 0 ELSE 1 END) "
        "FROM rewards WHERE source = 'judge'"
    )
    report["crash"] = {
        "killed after s": round(kill_at, 1),
        "stored before the kill": before,
        "rerun": rerun,
        "rerun s (wall, scoring)": [round(took, 1), rerun["seconds"]],
        "rerun per_s (scoring)": round(rerun["scored"] / rerun["seconds"], 1) if rerun["seconds"] else None,
    }
    checks = {
        "the killed run stored some, not all": 0 < before < args.episodes,
        "the rerun skipped what was stored": rerun["skipped"] == before,
        "the rerun scored the rest": rerun["scored"] == args.episodes - before and rerun["failed"] == 0,
        "one reward per episode": rewards == episodes == args.episodes,
        "every reward the judge's value": wrong == 0,
        "parallel faster than serial": one > many,
    }
    report["checks"] = checks
    print(json.dumps(report, indent=2))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
