"""Where a standalone `lcap collect --ray` spends its time: a timeline of one collect, event by event.

    .venv/bin/python benchmarks/ray_collect_timeline.py [--sizes 1,16] [--calls 4] [--concurrency 4] [--repeat 2]

Starts the same two-node `ray start` cluster and asyncio upstream as bench_ray_collect.py, then for each size runs
REPEAT collects of SIZE episodes (SIZE/2 tasks x 2; one task x 1 for SIZE 1) one after the other in a fresh driver
process: the first as the `lcap collect --ray` command runs (a new Ray job: `ray.init`, no worker of its own yet),
the next ones as bench_ray_collect.py's "proxies per collect" path runs (the job's workers warm, node proxies of
each collect's own). The driver's steps are timed by wrapping dataset/collect/on_ray.py's functions; a node proxy's
creation -> on its worker (its `placed()`, with whether that worker process existed before) -> ready (its
`ready()`) from a thread; the agents (bench_ray_collect.py's, plus a timestamp at their start and end) write when
they ran. Each line is seconds from the collect's call (the driver's `ray.init` included), then '+duration' for a
step. Then, in one driver, a bare probe of Ray's own cost on a node: an empty actor (defined in this small script)
from creation to its first answer, first with no worker of this driver's job on the node, then after tasks of the
job ran there (does an actor take an idle worker? its pid says).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ray_collect import two_node_cluster


def driver(args: argparse.Namespace) -> None:
    """One standalone collect in this (fresh) process, its steps timed; prints them as JSON lines."""
    import threading

    import psutil

    events: list[tuple[float, float | None, str]] = []
    lock = threading.Lock()

    def mark(label: str, t0: float, t1: float | None = None) -> None:
        with lock:
            events.append((t0, t1, label))

    def wrap(owner, name: str, label: str, each: bool = True) -> None:
        original = getattr(owner, name)
        seen = [0]

        def timed(*a, **k):
            t0 = time.time()
            try:
                return original(*a, **k)
            finally:
                seen[0] += 1
                if each or seen[0] == 1:
                    mark(label if each else f"{label} (first)", t0, time.time())

        setattr(owner, name, timed)

    t_start = time.time()
    import ray

    import lcap.ray_cluster
    from lcap.capture.storage.ingest import Ingest
    from lcap.capture.storage.writer import TurnWriter
    from lcap.dataset.collect import node_proxies
    from lcap.dataset.collect import on_ray as ray_collect
    from lcap.dataset.collect.episodes import collect_episodes
    from lcap.dataset.options import CollectOptions
    from lcap.store import Store

    import_end = time.time()
    wrap(lcap.ray_cluster, "connect", "driver connects (ray.init)")
    wrap(ray_collect.RayPool, "_nodes_that_fit", "nodes that fit (ray.nodes)")
    wrap(ray_collect.NodeProxies, "_start", "proxies created, writer and ingest started")
    wrap(ray_collect.NodeProxies, "close", "close (end of collect)")
    wrap(node_proxies, "_stop_proxies", "  node proxies stopped, last turns taken")
    wrap(Ingest, "stop", "  ingest thread stopped")
    wrap(node_proxies.ray, "kill", "  ray.kill")
    wrap(TurnWriter, "finish", "  writer finish (drain)")
    wrap(TurnWriter, "start", "writer process started")
    wrap(Ingest, "settle", "settle (writer flush)", each=False)

    submits: list[float] = []
    finishes: list[float] = []
    original_submit, original_finish = ray_collect._Run._submit, ray_collect._Run._finish

    def submit(self, attempt, ended):
        submits.append(time.time())
        return original_submit(self, attempt, ended)

    def finish(self, spec, outcome, ended):
        finishes.append(time.time())
        return original_finish(self, spec, outcome, ended)

    ray_collect._Run._submit, ray_collect._Run._finish = submit, finish

    original_start_proxy = node_proxies._start_proxy

    def start_proxy(config, node_id):
        before = set(psutil.pids())
        t0 = time.time()
        handle = original_start_proxy(config, node_id)

        def wait() -> None:
            pid = ray.get(handle.placed.remote())
            worker = "an idle worker" if pid in before else "a new worker process"
            mark(f"node proxy {node_id[:6]}: creation -> on its worker ({worker})", t0, time.time())
            ray.get(handle.ready.remote())
            mark(f"node proxy {node_id[:6]}: creation -> ready", t0, time.time())

        threading.Thread(target=wait, daemon=True).start()
        return handle

    node_proxies._start_proxy = start_proxy
    store = Store(Path(args.db))
    for n in range(args.collects):
        events.clear()
        submits.clear()
        finishes.clear()
        log = Path(args.db).with_name(f"agents-{args.round}-{n}.jsonl")
        tasks = Path(args.db).with_name(f"tasks-{args.round}-{n}.jsonl")
        tasks.write_text(
            "".join(
                json.dumps({"id": f"t{i}", "q": f"q{i}", "calls": args.calls, "log": str(log)}) + "\n"
                for i in range(max(1, args.size // args.group))
            )
        )
        options = CollectOptions(
            group_size=args.group,
            concurrency=args.concurrency,
            round=args.round * 100 + n,
            upstream=args.upstream,
            model="m",
            ray=args.address,
        )
        t0 = time.time()
        result = collect_episodes(
            store, tasks=tasks, command=[sys.executable, args.agent], options=options, progress=False
        )
        t_end = time.time()
        assert result.finished == result.episodes, result
        if n == 0:
            events.insert(0, (t_start, import_end, "imports (ray, lcap)"))
        agents = [json.loads(line) for line in log.read_text().splitlines()]
        out = {
            "t0": t0,
            "end": t_end,
            "events": list(events),
            "submits": submits,
            "finishes": finishes,
            "agents": agents,
        }
        print("TIMELINE " + json.dumps(out), flush=True)
        time.sleep(1)  # the last collect's proxies gone


def show(size: int, data: dict) -> None:
    t0 = data["t0"]
    rows: list[tuple[float, str]] = []
    for start, end, label in data["events"]:
        rows.append((start - t0, f"{label}" + (f"  +{end - start:.2f}s" if end is not None else "")))
    subs, fins, agents = data["submits"], data["finishes"], data["agents"]
    starts = sorted(a["start"] for a in agents)
    ends = sorted(a["end"] for a in agents)
    rows.append((subs[0] - t0, "first episode submitted"))
    rows.append((starts[0] - t0, "first agent started (on its node)"))
    rows.append((ends[0] - t0, "first agent ended"))
    rows.append((fins[0] - t0, "first episode recorded finished (driver)"))
    if size > 1:
        rows.append((subs[-1] - t0, "last episode submitted"))
        rows.append((starts[-1] - t0, "last agent started"))
        rows.append((ends[-1] - t0, "last agent ended"))
        rows.append((fins[-1] - t0, "last episode recorded finished"))
        runs = sorted(a["end"] - a["start"] for a in agents)
        gaps = [f - e for f, e in zip(sorted(fins), ends, strict=False)]
        rows.append((ends[-1] - t0, f"agents' own run time median {runs[len(runs) // 2]:.2f}s"))
        rows.append((fins[-1] - t0, f"agent end -> recorded, median {sorted(gaps)[len(gaps) // 2]:.2f}s"))
    rows.append((data["end"] - t0, "collect returned"))
    for at, text in sorted(rows):
        print(f"  {at:7.2f}  {text}")


def probes(address: str, tmp: Path) -> None:
    """Ray's own cost of an actor on a node, in one driver: an empty actor, cold and on a node with idle workers."""
    import psutil
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=address, logging_level="WARNING")

    @ray.remote(num_cpus=0)
    class Empty:
        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=1)
    def warm() -> int:
        return os.getpid()

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    for node in nodes:
        pinned = NodeAffinitySchedulingStrategy(node, soft=False)
        workers = set(psutil.pids())
        t0 = time.time()
        pid = ray.get(Empty.options(scheduling_strategy=pinned).remote().pid.remote())
        print(
            f"  empty actor on node {node[:6]}: creation -> answer {time.time() - t0:.2f}s, "
            f"{'an idle worker that existed' if pid in workers else 'a new worker process'} (pid {pid})"
        )
        ray.get([warm.options(scheduling_strategy=pinned).remote() for _ in range(2)])  # this job's idle workers
        time.sleep(1)
        workers = set(psutil.pids())
        t0 = time.time()
        pid = ray.get(Empty.options(scheduling_strategy=pinned).remote().pid.remote())
        print(
            f"  empty actor on node {node[:6]} after tasks of this job ran there: creation -> answer "
            f"{time.time() - t0:.2f}s, {'an idle worker that existed' if pid in workers else 'a new worker process'}"
        )
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--collects", type=int, default=1, help=argparse.SUPPRESS)
    for name in ("db", "agent", "address", "upstream"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        driver(args)
        return

    with two_node_cluster("lcap-bench-timeline-", args.concurrency) as bench:
        tmp, agent, url, address = bench.tmp, bench.agent, bench.url, bench.address
        print(f"load average {', '.join(f'{v:.2f}' for v in os.getloadavg())}")
        for round, size in enumerate([int(s) for s in args.sizes.split(",")], start=1):
            group = 1 if size == 1 else 2
            command = [
                sys.executable,
                __file__,
                "--driver",
                "--db",
                str(tmp / f"timeline-{size}.duckdb"),
                "--agent",
                str(agent),
                "--address",
                address,
                "--upstream",
                url,
                "--round",
                str(round),
                "--group",
                str(group),
                "--size",
                str(size),
                "--calls",
                str(args.calls),
                "--concurrency",
                str(args.concurrency),
                "--collects",
                str(args.repeat),
            ]
            run = subprocess.run(command, capture_output=True, text=True)
            lines = [x for x in run.stdout.splitlines() if x.startswith("TIMELINE ")]
            if run.returncode or len(lines) != args.repeat:
                raise SystemExit(f"driver failed: {run.stdout[-3000:]}{run.stderr[-3000:]}")
            for n, line in enumerate(lines):
                which = "a fresh driver: its first collect" if n == 0 else f"the same driver's collect #{n + 1}"
                print(f"\n{size} episodes, {which} (load {', '.join(f'{v:.2f}' for v in os.getloadavg())}):")
                show(size, json.loads(line[len("TIMELINE ") :]))
        print("\nRay's own cost of an actor on a node (one driver):")
        probes(address, tmp)


if __name__ == "__main__":
    main()
