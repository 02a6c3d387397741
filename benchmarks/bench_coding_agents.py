"""Real coding agents through `lcap collect --sandbox` on the policy route: mini-swe-agent, Codex and Claude Code
(`--agents mini,codex,claude`), unmodified, on minibugs tasks, each episode in a bubblewrap sandbox of its own.

    .venv/bin/python benchmarks/bench_coding_agents.py --model tiny --out /tmp/coding      # the tiny random model
    .venv/bin/python benchmarks/bench_coding_agents.py --model smollm2 --out /tmp/coding   # SmolLM2-135M, 8k context

The model is served by `lcap serve` in an LCAP_HOME of its own under OUT (lcap's vLLM venv linked in), stopped at
the end. Each agent then collects `--episodes` episodes at `--concurrency` (`--group-size` per task, 1 by default,
so that each episode's task is its own): every task gets a MARKER.txt with a random marker, and the workspaces are
kept (`--keep-workspaces`). What it prints per agent, as JSON, read from the store: episodes by status, calls per
episode, turns with exact ids, calls by HTTP status and the errors stored, rewards stored (minibugs' verifier),
wall time and load; and the isolation check: each kept workspace holds its own marker and no other, and no
episode's calls (requests and answers) show another episode's marker.

The harnesses are installed where the sandbox's user (nobody) can run them: LCAP_HARNESS_DIR, default
/var/cache/lcap-harnesses, made by scripts/harnesses/install.sh with LCAP_HARNESS_PYTHON=/usr/bin/python3.
Needs root, bubblewrap and cgroups v1 (`lcap doctor sandbox`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import duckdb

REPO = Path(__file__).resolve().parents[1]
LCAP = str(Path(sys.executable).parent / "lcap")
HARNESSES = REPO / "scripts" / "harnesses"
MINIBUGS = REPO / "scripts" / "tasks" / "minibugs"
SCRIPTS = {"mini": "mini.sh", "codex": "codex.sh", "claude": "claude.sh"}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def make_tasks(out: Path, count: int, seed: int) -> tuple[Path, dict[str, str]]:
    """`count` minibugs tasks, each with a MARKER.txt of its own; (tasks file, task id -> marker)."""
    bugs = out / "minibugs"
    if not (bugs / "train.jsonl").exists():
        subprocess.run(
            [sys.executable, str(MINIBUGS / "make.py"), "--seed", str(seed), "--per-function", "3", "--out", str(bugs)],
            check=True,
        )
    rows = [json.loads(line) for name in ("train", "heldout") for line in (bugs / f"{name}.jsonl").open()]
    if len(rows) < count:
        sys.exit(f"minibugs has {len(rows)} tasks, {count} asked")
    markers = {}
    tasks = bugs / f"marked-{count}.jsonl"
    with tasks.open("w") as f:
        for row in rows[:count]:
            markers[row["id"]] = f"lcap-marker-{secrets.token_hex(12)}"
            row["split"] = "train"
            row["files"] = {"MARKER.txt": markers[row["id"]] + "\n"}
            f.write(json.dumps(row) + "\n")
    return tasks, markers


def serve(model: str, out: Path, env: dict[str, str], context: int | None) -> None:
    home = Path(env["LCAP_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    venv = Path(os.environ.get("LCAP_HOME") or Path.home() / ".lcap") / "vllm-venv"
    if venv.is_dir() and not (home / "vllm-venv").exists():
        (home / "vllm-venv").symlink_to(venv, target_is_directory=True)
    model_dir = out / model
    if not model_dir.exists():
        source = [] if model == "tiny" else ["--from", model]
        subprocess.run([LCAP, "init-model", str(model_dir), *source], env=env, check=True)
    args = [LCAP, "serve", "--model", str(model_dir), "--name", model, "--db", str(home / "serve.duckdb")]
    args += ["--timeout", "1800"]  # a loaded machine starts vLLM slowly
    if context:
        args += ["--", "--max-model-len", str(context)]
    t0 = time.perf_counter()
    subprocess.run(args, env=env, check=True)
    print(f"served {model} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def collect(agent: str, args: argparse.Namespace, tasks: Path, out: Path, env: dict[str, str]) -> dict:
    work = out / agent
    work.mkdir(parents=True, exist_ok=True)
    command = [LCAP, "collect", "--db", str(work / "lcap.duckdb"), "--tasks", str(tasks)]
    command += ["-g", str(args.group_size), "-j", str(args.concurrency), "--timeout", str(args.timeout)]
    command += ["--sandbox", "--keep-workspaces", "--run-dir", str(work / "run"), "--verify-failed"]
    command += ["--verifier", f"{MINIBUGS / 'verify.py'}:verify", "--", str(HARNESSES / SCRIPTS[agent]), "{prompt}"]
    before = load()
    t0 = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (work / "collect.log").write_text(done.stdout + done.stderr)
    return {
        "agent": agent,
        "exit": done.returncode,
        "wall_s": round(wall, 1),
        "load_before": before,
        "load_after": load(),
        "summary": done.stdout.strip().splitlines()[:1],
    }


def report(agent: str, out: Path, markers: dict[str, str]) -> dict:
    db = duckdb.connect(str(out / agent / "lcap.duckdb"), read_only=True)
    q = lambda sql: db.execute(sql).fetchall()  # noqa: E731
    episodes = q("SELECT episode_id, task_id, status, n_turns, reward, error FROM episode_summary")
    turns = q(
        "SELECT episode_id, status_code, error, token_source = 'vllm' AND len(prompt_token_ids) > 0 "
        "AND len(completion_token_ids) > 0, CAST(request AS VARCHAR) || coalesce(CAST(response AS VARCHAR), '') "
        "|| coalesce(completion_text, '') FROM turns"
    )
    by_episode = {e[0]: e for e in episodes}
    calls = [e[3] for e in episodes]
    errors = Counter(f"{code} {(error or '')[:200]}" for _, code, error, _, _ in turns if code != 200 or error)
    # Isolation: each kept workspace holds its own marker and no other; no episode's calls show another's.
    leaks, wrong = [], []
    for episode_id, task_id, *_ in episodes:
        mine = markers[task_id]
        others = [m for t, m in markers.items() if t != task_id]
        workspace = next((out / agent / "run").glob(f"round-*/{episode_id}/work"), None)
        if workspace is None or (workspace / "MARKER.txt").read_text().strip() != mine:
            wrong.append(episode_id)
            continue
        for path in workspace.rglob("*"):
            if path.is_file() and any(m.encode() in path.read_bytes() for m in others):
                leaks.append(f"{episode_id}: {path.name}")
    for episode_id, _, _, _, text in turns:
        task_id = by_episode[episode_id][1] if episode_id in by_episode else None
        if any(m in text for t, m in markers.items() if t != task_id):
            leaks.append(f"{episode_id}: a call")
    return {
        "episodes": len(episodes),
        "by_status": dict(Counter(e[2] for e in episodes)),
        "calls_per_episode": {
            "min": min(calls, default=0),
            "median": statistics.median(calls or [0]),
            "max": max(calls, default=0),
            "total": sum(calls),
        },
        "turns_with_ids": sum(1 for t in turns if t[3]),
        "calls_by_status": dict(Counter(str(t[1]) for t in turns)),
        "call_errors": dict(errors.most_common(5)),
        "rewarded": sum(1 for e in episodes if e[4] is not None),
        "mean_reward": round(statistics.mean([e[4] for e in episodes if e[4] is not None] or [0]), 3),
        "episode_errors": dict(Counter((e[5] or "")[:160] for e in episodes if e[2] != "ok").most_common(3)),
        "workspaces_checked": len(episodes) - len(wrong),
        "workspace_without_its_marker": wrong,
        "leaks": leaks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--agents", default="mini,codex", help=f"comma-separated, of {','.join(SCRIPTS)}")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--max-turns", type=int, default=3, help="LCAP_MAX_TURNS: mini-swe-agent's and Claude Code's turn limit"
    )
    parser.add_argument(
        "--max-output-tokens", type=int, default=64, help="LCAP_MAX_OUTPUT_TOKENS (mini-swe-agent, Claude Code)"
    )
    parser.add_argument("--claude-tools", default="", help="LCAP_CLAUDE_TOOLS (e.g. Bash,Write; default: all)")
    parser.add_argument("--context", type=int, help="vLLM --max-model-len (default: the model's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out = args.out.resolve() / args.model
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o755)
    env = dict(
        os.environ,
        LCAP_HOME=str(out / "home"),
        LCAP_POLICY_RECORD=str(out / "home" / "policy.json"),
        LCAP_HARNESS_DIR=os.environ.get("LCAP_HARNESS_DIR", "/var/cache/lcap-harnesses"),
        LCAP_MAX_TURNS=str(args.max_turns),
        LCAP_MAX_OUTPUT_TOKENS=str(args.max_output_tokens),
        LCAP_CLAUDE_TOOLS=args.claude_tools,
    )
    tasks, markers = make_tasks(out, args.episodes // args.group_size, args.seed)
    serve(args.model, out, env, args.context)
    try:
        for agent in args.agents.split(","):
            run = collect(agent, args, tasks, out, env)
            run.update(report(agent, out, markers))
            print(json.dumps({"model": args.model, **run}), flush=True)
    finally:
        subprocess.run([LCAP, "serve", "--stop"], env=env)


if __name__ == "__main__":
    main()
