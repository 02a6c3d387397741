"""The synchronous and the overlapped loop side by side, in one run: trained groups per hour and held-out reward.

    .venv/bin/python benchmarks/bench_async_loop.py [--out bench-async] [--rounds 4] [--seed 0]
        [--tasks-per-round 8] [--group-size 4] [--concurrency 8] [--max-staleness 1]
        [--median 2] [--sigma 1.2] [--cap 30] [--eval 128] [--python VLLM_PYTHON] [--max-step-kl 0]

The demo's tiny warm-started model, tasks and verifier (loop/demo/runner.py), one vLLM CPU server for both loops,
and an agent whose episodes spend most of their time in a tool call of uneven length:
scripts/agents/tool_sleeper.py sleeps a log-normal time (median `--median` s, shape `--sigma`, capped at
`--cap`) seeded by the task and sample, then asks the policy. Both loops get the same tasks in the same
order, the same policy (the server is put back on the base model between them), the same seed and the same
sleeps; each has its own store and run folder under --out. The held-out set (--eval tasks, one episode each) is
evaluated before the first step and after each one, in both. The bench's policy server has its own record under
--out (it never stops or changes a server of the user's); any LCAP_HOME works, an empty one included (its vLLM:
--python, else lcap's vLLM venv found as `lcap serve` finds it). A step with nothing to learn is skipped, as in
any loop: its groups count as untrained.

Prints one table: per loop, the wall time of its steps (from the end of the base policy's held-out run to
the last step's), the groups trained, trained groups per hour, the trainer's and the agents' waiting time,
samples dropped as stale, and the held-out reward after each step with its 95% interval (Wilson for 0/1
rewards, else normal; the curve per trained group: each step trains --tasks-per-round groups), each trained
step's step KL (a refused one starred: the synchronous loop's gate, or --max-step-kl on the overlapped loop's
ungated steps), then whether the overlapped loop's last held-out reward lies in the synchronous loop's interval.
The overlapped loop's target:
>= 1.5x the groups per hour, with held-out reward within the synchronous loop's 95% interval.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench-async"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks-per-round", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--median", type=float, default=2.0)
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--cap", type=float, default=30.0)
    ap.add_argument("--eval", type=int, default=128, help="held-out tasks, one episode each, per evaluation")
    ap.add_argument("--python", default=None, help="vLLM's interpreter (default: as `lcap serve` finds it)")
    ap.add_argument(
        "--max-step-kl", type=float, default=0.0, help="lcap loop's --max-step-kl (the ungated async steps; 0: off)"
    )
    args = ap.parse_args()

    import torch
    from transformers.utils.logging import disable_progress_bar

    from lcap.dataset.options import BuildOptions, CollectOptions
    from lcap.loop.demo.number import write_jsonl
    from lcap.loop.demo.runner import MODEL, demo_task
    from lcap.loop.demo.task import DemoSettings, demo_dir
    from lcap.loop.options import LoopOptions
    from lcap.loop.rounds import run_loop
    from lcap.loop.steps import LoopConfig
    from lcap.policy import read_policy, write_policy
    from lcap.serve.server import start_server, stop_server
    from lcap.serve.tiny_model import init_model
    from lcap.store import Store
    from lcap.train.options import TrainOptions

    disable_progress_bar()
    torch.set_num_threads(1)
    from lcap.serve.vllm_process import resolve_python

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = resolve_python(args.python)  # lcap's vLLM venv, found (or made) where LCAP_HOME points
    os.environ.setdefault("LCAP_HOME", str(out / "home"))
    # The bench's own server record, whatever LCAP_HOME says: it starts and stops that server, never the user's.
    record = out / "home" / "policy.json"
    os.environ["LCAP_POLICY_RECORD"] = str(record)
    os.environ.setdefault("OPENAI_API_KEY", "bench-placeholder")  # the SDK wants one; the policy route ignores it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for folder in (Path(os.environ["LCAP_HOME"]), record.parent):
        folder.mkdir(parents=True, exist_ok=True)
    settings = DemoSettings(seed=args.seed, tasks_per_round=args.tasks_per_round, group_size=args.group_size)
    number = demo_task("number")

    model = out / "model"
    if not (model / "warm_start.json").exists():
        print(f"making and warm-starting the demo's tiny model in {model}", flush=True)
        shutil.rmtree(model, ignore_errors=True)
        init_model(model, replace(MODEL, seed=args.seed))
        report = number.warm_start(model, settings)
        (model / "warm_start.json").write_text(json.dumps(report))
    train_tasks, held_out = number.tasks(
        replace(settings, n_train=args.tasks_per_round * args.rounds, n_eval=args.eval)
    )
    tasks = write_jsonl(out / "tasks.jsonl", train_tasks)
    eval_tasks = write_jsonl(out / "heldout.jsonl", held_out)
    agent = [sys.executable, str(ROOT / "scripts" / "agents" / "tool_sleeper.py"), "--question", "{question}"]
    agent += ["--sample", "{sample}", "--median", str(args.median), "--sigma", str(args.sigma)]
    agent += ["--cap", str(args.cap), "--seed", str(args.seed)]

    if read_policy() is not None:  # an earlier bench's server, left running
        stop_server()
    print("starting vLLM on the tiny model", flush=True)
    start_server(str(model), python=python, log_path=out / "vllm.log")
    results = {}
    try:
        base = read_policy()
        assert base is not None
        for name, overlap in (("sync", False), ("async", True)):
            record = read_policy()
            assert record is not None
            record.current = base.served_model  # the same starting policy for both
            write_policy(record)
            folder = out / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            config = LoopConfig(
                run=folder / "run",
                rounds=args.rounds,
                tasks=tasks,
                command=agent,
                eval_tasks=eval_tasks,
                tasks_per_round=args.tasks_per_round,
                collect=CollectOptions(
                    group_size=args.group_size,
                    concurrency=args.concurrency,
                    timeout=args.cap + 120,
                    verifier=f"{demo_dir() / 'verify.py'}:verify",
                ),
                build=BuildOptions(truncated="keep"),
                train=TrainOptions(
                    base_model=str(model),
                    learning_rate=settings.lr,
                    epochs=settings.epochs,
                    epsilon_high=settings.epsilon_high,
                    batch_size=settings.batch_size,
                    report_to="none",
                    seed=args.seed,
                ),
                options=LoopOptions(overlap=overlap, max_staleness=args.max_staleness, max_step_kl=args.max_step_kl),
            )
            store = Store(folder / "lcap.duckdb")
            print(f"--- {name} loop", flush=True)
            marks: dict[str, float] = {}

            def echo(line: str, marks: dict[str, float] = marks) -> None:
                print(line, flush=True)
                marks.setdefault("start", time.monotonic()) if line.startswith("round 0") else None
                marks["end"] = time.monotonic()

            cwd = Path.cwd()
            os.chdir(folder)  # the episodes' folders
            try:
                t0 = time.monotonic()
                run_loop(store, config, echo=echo)
            finally:
                os.chdir(cwd)
            results[name] = _figures(store, folder / "run", marks["end"] - marks.get("start", t0), args)
    finally:
        stop_server()
    _print(results, args)


def _figures(store, run: Path, seconds: float, args) -> dict:
    """One loop's figures, measured the same way for both: trained groups from each trained step's dataset report
    (groups with two or more samples; a step skipped with nothing to learn trains none), the agents' idle time as
    the steps' wall time less the training episodes' busy time over the slots, the trainer's wait as the time it
    had no batch to train on, and each held-out evaluation's rewards."""
    state = json.loads((run / "state.json").read_text())["steps"]
    steps = range(1, args.rounds + 1)
    trained = [n for n in steps if f"{n}:train" in state]
    groups = sum(
        json.loads((run / f"round-{n}" / "data" / "report.json").read_text())["groups"]["trainable"] for n in trained
    )
    rewards: dict[int, list[float]] = {}
    for n, reward in store.fetchall(
        "SELECT round, reward FROM episode_summary WHERE split = 'eval' AND reward IS NOT NULL ORDER BY round"
    ):
        rewards.setdefault(n, []).append(reward)
    ((busy,),) = store.fetchall("SELECT coalesce(sum(duration_s), 0) FROM episode_summary WHERE split = 'train'")
    overlapped = any(f"{n}:batch" in state for n in steps)
    if overlapped:
        ((trainer_wait, dropped),) = store.fetchall("SELECT sum(trainer_wait_s), sum(dropped_stale) FROM async_steps")
    else:  # the synchronous trainer waits for each round's whole collect
        trainer_wait, dropped = sum(state[f"{n}:collect"]["seconds"] for n in steps if f"{n}:collect" in state), 0
    return {
        "seconds": seconds,
        "groups": groups,
        "per_hour": groups * 3600 / seconds,
        "trainer_wait_s": trainer_wait,
        "agent_wait_s": seconds - busy / args.concurrency,
        "dropped": dropped or 0,
        "skipped": [n for n in steps if f"{n}:skipped" in state],
        "refused": [n for n in steps if state.get(f"{n}:promote", {}).get("promoted") is False],
        "step_kl": dict(store.fetchall("SELECT round, step_kl FROM train_runs ORDER BY round")),
        "held_out": [_interval(rewards.get(n, [])) for n in range(0, args.rounds + 1)],
    }


def _interval(rewards: list[float]) -> tuple[float, float, float, int] | None:
    """Mean reward, its 95% interval and the count: Wilson's for 0/1 rewards, else mean +- 1.96 standard errors."""
    n = len(rewards)
    if not n:
        return None
    mean = sum(rewards) / n
    z = 1.96
    if all(r in (0, 1) for r in rewards):
        centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return mean, centre - half, centre + half, n
    sd = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
    return mean, mean - z * sd / math.sqrt(n), mean + z * sd / math.sqrt(n), n


def _print(results: dict, args) -> None:
    fmt = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    shown = lambda c: "-" if c is None else f"{c[0]:.3f} [{c[1]:.3f}, {c[2]:.3f}] n={c[3]}"  # noqa: E731
    print()
    print(
        f"rounds {args.rounds} x {args.tasks_per_round} groups of {args.group_size}, concurrency {args.concurrency}, "
        f"tool time log-normal median {args.median}s sigma {args.sigma} cap {args.cap}s, seed {args.seed}, "
        f"--max-staleness {args.max_staleness}, held-out {args.eval} episodes per evaluation"
    )
    print(
        "| loop | steps wall s | groups trained | groups / hour | trainer waited s | agents idle s | dropped stale |"
        " skipped steps |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['seconds']:.0f} | {r['groups']} | {r['per_hour']:.0f} | {fmt(r['trainer_wait_s'], 0)} | "
            f"{fmt(r['agent_wait_s'], 0)} | {r['dropped']} | {' '.join(map(str, r['skipped'])) or '-'} |"
        )
    print("\nheld-out reward, mean [95% interval]: base, then after each step")
    for name, r in results.items():
        print(f"{name}: " + " | ".join(shown(c) for c in r["held_out"]))
    print(
        "\nstep KL of each trained step (how far it moved the policy; * refused: not deployed, by the gate or --max-step-kl)"
    )
    for name, r in results.items():
        steps = (f"{n}: {kl:.3g}{'*' if n in r['refused'] else ''}" for n, kl in r["step_kl"].items() if kl is not None)
        print(f"{name}: " + (" | ".join(steps) or "-"))
    if "sync" in results and "async" in results:
        sync, overlapped = results["sync"], results["async"]
        ratio = overlapped["per_hour"] / sync["per_hour"] if sync["per_hour"] else float("nan")
        print(f"\noverlapped / synchronous groups per hour: {ratio:.2f}x")
        last = lambda r: next((c for c in reversed(r["held_out"]) if c is not None), None)  # noqa: E731
        a, b = last(overlapped), last(sync)
        if a is not None and b is not None:
            inside = "within" if b[1] <= a[0] <= b[2] else "outside"
            print(
                f"overlapped's last held-out reward {a[0]:.3f} is {inside} the synchronous one's [{b[1]:.3f}, {b[2]:.3f}]"
            )


if __name__ == "__main__":
    main()
