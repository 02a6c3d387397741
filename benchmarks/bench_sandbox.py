"""What `--sandbox` costs: per episode, per workspace, per collect and per idle sandbox, side by side in one run.

    .venv/bin/python benchmarks/bench_sandbox.py [--episodes 40] [--template-files 20] [--big-mb 50]
        [--minibugs-tasks 46] [--idle 8] [--skip overhead,workspace,throughput,idle]

Needs what `--sandbox` needs (root, bubblewrap, cgroups v1). Four parts, each printed as it ends:

- overhead: the same episodes (`/bin/true` as the agent, a task whose workspace holds --template-files small files)
  run one after another through `run_episode`, without and with a sandbox, alternating in pairs so that load falls
  on both alike; the median and the 90th percentile of each and what the sandbox adds. Target: <= 50 ms added.
- workspace: setting up and removing one sandbox's workspace (no agent) filled with a small workspace and a
  --big-mb one, both ways: a tmpfs the files are copied into and chowned (copy), or an overlay over a lower layer
  made once (overlay; the lower layer's one-time copy reported apart).
- throughput: `lcap collect` over the minibugs set (scripts/tasks/minibugs/make.py --seed 0, its first
  --minibugs-tasks tasks) with a scripted agent that writes the task's fix (no LLM) and the minibugs verifier,
  -j 2, without and with --sandbox (whose verifier then runs in a sandbox of its own too): episodes per minute
  and their ratio.
- idle: --idle sandboxes at once whose agent sleeps: the memory cgroup's usage and the resident memory of each
  sandbox's processes, and of the bubblewrap process that waits outside for each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from machine import processes

from lcap.capture.options import ProxyOptions, SandboxLimits
from lcap.capture.proxy.server import CaptureProxy
from lcap.capture.sandbox import CGROUPS, GROUP, Sandbox, missing
from lcap.dataset.collect.episode import EpisodeRules, EpisodeSpec, TaskFiles, run_episode
from lcap.dataset.collect.episodes import collect_episodes
from lcap.dataset.options import CollectOptions
from lcap.store import Store

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"  # the sandboxed agent runs as nobody, who cannot reach a Python under /root
FIXER = "import json, os\ntask = json.loads(os.environ['LCAP_TASK'])\nopen(task['module'], 'w').write(task['fix'])\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--template-files", type=int, default=20)
    parser.add_argument("--big-mb", type=int, default=50)
    parser.add_argument("--minibugs-tasks", type=int, default=46)
    parser.add_argument("--idle", type=int, default=8)
    parser.add_argument("--skip", default="", help="parts to skip, comma-separated")
    args = parser.parse_args()
    if reason := missing():
        sys.exit(f"bench_sandbox: {reason}")
    skip = set(filter(None, args.skip.split(",")))
    base = Path(tempfile.mkdtemp(prefix="lcap-bench-sandbox-"))
    base.chmod(0o755)
    os.environ["LCAP_HOME"] = str(base / "home")
    print(f"load average at start: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} CPUs")
    try:
        if "overhead" not in skip:
            overhead(base / "overhead", args.episodes, args.template_files)
        if "workspace" not in skip:
            workspaces(base / "workspace", args.template_files, args.big_mb)
        if "throughput" not in skip:
            throughput(base / "throughput", args.minibugs_tasks)
        if "idle" not in skip:
            idle(base / "idle", args.idle)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


def _fill(folder: Path, files: int, size: int) -> None:
    folder.mkdir(parents=True)
    for i in range(files):
        (folder / f"file{i}.py").write_bytes(b"x = 1\n" * (size // 6))


def overhead(base: Path, episodes: int, template_files: int) -> None:
    _fill(base / "tasks" / "template", template_files, 300)
    store = Store(base / "db" / "lcap.duckdb")
    proxy = CaptureProxy(store, ProxyOptions(upstream=None))
    proxy.start()
    run_dir = base / "runs"
    run_dir.mkdir()
    sandbox = Sandbox(SandboxLimits(512, 64, 64), proxy, [run_dir], [store.path], cache=run_dir)
    try:
        rules = EpisodeRules(None, (), 30.0)
        files = TaskFiles(base / "tasks")
        times: dict[str, list[float]] = {"plain": [], "sandbox": []}
        for n in range(episodes):
            for kind in ("plain", "sandbox") if n % 2 else ("sandbox", "plain"):
                eid = f"bench-{kind}-{n}"
                spec = EpisodeSpec(eid, {"id": "t", "workspace": "template"}, 0, ["/bin/true"], run_dir / eid, {})
                start = time.perf_counter()
                with proxy.episode_child(eid, spec.argv) as agent:
                    outcome = run_episode(
                        spec,
                        agent.env,
                        rules,
                        files,
                        flush=lambda: True,
                        agent=agent,
                        sandbox=sandbox if kind == "sandbox" else None,
                    )
                times[kind].append(time.perf_counter() - start)
                if outcome.status != "ok":
                    sys.exit(f"bench_sandbox: episode {eid} {outcome.status}: {outcome.reason}")
    finally:
        sandbox.close()
        proxy.stop()
    rows = {k: (statistics.median(v) * 1e3, statistics.quantiles(v, n=10)[-1] * 1e3) for k, v in times.items()}
    print(f"overhead ({episodes} episodes each, {template_files} workspace files, first sandboxed one included):")
    for kind, (median, p90) in rows.items():
        print(f"  {kind:8s} episode: median {median:6.1f} ms, p90 {p90:6.1f} ms")
    added = rows["sandbox"][0] - rows["plain"][0]
    print(f"  --sandbox adds {added:.1f} ms per episode (median; target <= 50 ms)")


def workspaces(base: Path, small_files: int, big_mb: int) -> None:
    sources = {"small": base / "small", "big": base / "big"}
    _fill(sources["small"], small_files, 300)
    _fill(sources["big"], 200, (big_mb << 20) // 200)
    run_dir = base / "runs"
    run_dir.mkdir()
    sandbox = Sandbox(SandboxLimits(512, 64, 4 * big_mb), None, [run_dir], [], cache=run_dir)  # type: ignore[arg-type]
    rounds = 10
    try:
        print(f"workspace set-up + teardown (median of {rounds}; small: {small_files} files, big: {big_mb} MiB):")
        for size, source in sources.items():
            start = time.perf_counter()
            lower = sandbox.lower(source)
            once = time.perf_counter() - start
            times: dict[str, list[float]] = {"copy": [], "overlay": []}
            for n in range(rounds):
                for mode in ("copy", "overlay") if n % 2 else ("overlay", "copy"):
                    box = sandbox.episode(f"ws-{size}-{mode}-{n}", run_dir / f"{size}-{mode}-{n}" / "work")
                    start = time.perf_counter()
                    if mode == "copy":
                        box.prepare()
                        shutil.copytree(source, box.workdir, dirs_exist_ok=True, symlinks=True)
                    else:
                        box.prepare(lower=lower)
                    box.own()
                    box.close()
                    times[mode].append(time.perf_counter() - start)
            copy, overlay = (statistics.median(times[m]) * 1e3 for m in ("copy", "overlay"))
            print(
                f"  {size:5s}: copy {copy:7.1f} ms, overlay {overlay:7.1f} ms ({copy / overlay:.1f}x), "
                f"overlay's lower layer once per run {once * 1e3:.1f} ms"
            )
    finally:
        sandbox.close()


def throughput(base: Path, limit: int) -> None:
    sets = base / "minibugs"
    subprocess.run(
        [sys.executable, str(REPO / "scripts/tasks/minibugs/make.py"), "--seed", "0", "--out", str(sets)], check=True
    )
    fixes = {row["id"]: row["original"] for row in map(json.loads, (sets / "fixes.jsonl").read_text().splitlines())}
    tasks = [json.loads(line) for line in (sets / "train.jsonl").read_text().splitlines()][:limit]
    (sets / "bench.jsonl").write_text("".join(json.dumps({**t, "fix": fixes[t["id"]]}) + "\n" for t in tasks))
    (sets / "warm.jsonl").write_text("".join(json.dumps({**t, "fix": fixes[t["id"]]}) + "\n" for t in tasks[:2]))
    (base / "fixer.py").write_text(FIXER)
    verifier = f"{REPO / 'scripts/tasks/minibugs/verify.py'}:verify"
    per_minute: dict[str, float] = {}
    print(f"throughput: lcap collect, {len(tasks)} minibugs tasks, scripted fixer agent, -j 2:")
    for kind in ("warm-up", "plain", "sandbox"):
        store = Store(base / f"db-{kind}" / "lcap.duckdb")
        options = CollectOptions(
            group_size=1,
            concurrency=2,
            upstream=None,
            verifier=verifier,
            sandbox=kind == "sandbox",
            run_dir=base / f"run-{kind}",
        )
        start = time.perf_counter()
        task_file = sets / ("warm.jsonl" if kind == "warm-up" else "bench.jsonl")
        result = collect_episodes(
            store, tasks=task_file, command=[SYSTEM_PYTHON, str(base / "fixer.py")], options=options
        )
        seconds = time.perf_counter() - start
        if kind == "warm-up":  # the first collect of a process pays its imports and bytecode: neither's cost
            continue
        per_minute[kind] = result.episodes / seconds * 60
        print(
            f"  {kind:8s}: {result.episodes} episodes in {seconds:.1f} s = {per_minute[kind]:.0f} episodes/min, "
            f"{result.finished} ok, mean reward {result.mean_reward}"
        )
    print(f"  with --sandbox: {per_minute['sandbox'] / per_minute['plain']:.2f}x the episodes per minute")


def idle(base: Path, count: int) -> None:
    base.mkdir(parents=True)
    store = Store(base / "db" / "lcap.duckdb")
    tasks = base / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"idle{i}"}) + "\n" for i in range(count)))
    samples: list[tuple[int, int, int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            usage = rss = sandboxes = 0
            for group in (CGROUPS / "memory" / GROUP).glob(f"*-{os.getpid()}"):
                try:
                    usage += int((group / "memory.usage_in_bytes").read_text())
                    pids = (group / "cgroup.procs").read_text().split()
                except OSError:
                    continue
                sandboxes += 1
                rss += sum(_rss(int(p)) for p in pids)
            outside = sum(_rss(p.pid) for p in processes() if p.comm == "bwrap" and p.ppid == os.getpid())
            samples.append((sandboxes, usage, rss, outside))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    options = CollectOptions(
        group_size=1, concurrency=count, upstream=None, sandbox=True, run_dir=base / "run", timeout=60.0
    )
    try:
        for agent, argv in (
            ("sleep", ["/bin/sleep", "6"]),
            ("python", [SYSTEM_PYTHON, "-c", "import time; time.sleep(6)"]),
        ):
            samples.clear()
            collect_episodes(store, tasks=tasks, command=argv, options=options, progress=False)
            full = [s for s in samples if s[0] == count]
            if not full:
                print(f"idle ({agent}): never saw {count} sandboxes at once")
                continue
            usage, rss, outside = (statistics.median(s[i] for s in full) / count / 2**20 for i in (1, 2, 3))
            print(
                f"idle: {count} sandboxes whose agent is {' '.join(argv[:1])} sleeping: per sandbox, memory cgroup "
                f"{usage:.1f} MiB, its processes' RSS {rss:.1f} MiB, bubblewrap outside {outside:.1f} MiB"
            )
    finally:
        done.set()


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    main()
