"""`lcap collect` through the local pool and through a two-node local Ray cluster, side by side in one run, and the
store's ingest rate from a remote node.

    .venv/bin/python benchmarks/bench_ray_collect.py [--sizes 16,64] [--group 2] [--calls 4] [--concurrency 4]
        [--rounds 3] [--latency 0] [--ingest 20000]

Starts a minimal asyncio upstream (benchmarks/bench_proxy.py's) and a Ray cluster of two `ray start` nodes on this
machine (node IP 127.0.0.1, CONCURRENCY/2 CPUs each), then, for each size in SIZES (episodes per collect: SIZE/GROUP
tasks x GROUP), runs the same episodes (a trivial agent: CALLS chat completions through its capture proxy with
httpx, then one line to a file; the upstream answers each after LATENCY seconds, 0 by default) through five paths in
turn, ROUNDS times each after one warm-up run of each:

* local pool: one proxy, a thread pool;
* ray, proxies per collect: `--ray` in this process (an episode per Ray task, a proxy per node started with the
  collect and stopped at its end, turns handed to the driver's writer);
* ray, proxies kept: the same, with the node proxies kept across all that path's collects of the size (warm-up
  included), as `lcap loop --ray` keeps them across its rounds' collects;
* the commands: `lcap collect` and `lcap collect --ray`, each a new process, as a user runs them: what the in-process
  paths above do not count (the interpreter, imports, joining the cluster, and for `--ray` a new Ray job, whose
  episode tasks each need a new worker process on their node, besides its node proxies).

Episodes/s is episodes over the collect's wall time, median over the rounds; "/ local" compares the in-process paths
with the local pool and `lcap collect --ray` with `lcap collect`. Every run must store episodes x CALLS turns.
"one-episode collect" is a collect of one task, one sample, after each run: what a collect costs before and after its
episodes (its proxies' start and stop, when it starts them). The load averages (`uptime`'s) are printed before and
after each size.

Ingest: an Outbox (capture/storage/outbox.py) in an actor on the worker node is filled with INGEST turns, then the driver's
real ingest (capture/storage/ingest.py: takes, reseals, the one TurnWriter) moves them into a fresh store: turns/s from
the first take to the last turn in the store; beside it, the same turns put straight into a local TurnWriter (what
a local proxy does), the writer's own rate on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proxy import UPSTREAM

AGENT = r"""
import json, os, time, httpx
start = time.time()
task = json.loads(os.environ["LCAP_TASK"])
key = os.environ.get("OPENAI_API_KEY", "none")  # sent as a client sends one; the stand-in upstream reads none
with httpx.Client(timeout=30) as client:  # HTTPS_PROXY and lcap's CA from the environment lcap gives
    for i in range(task["calls"]):
        r = client.post("https://api.openai.com/v1/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": f"{task['q']} {i}"}]},
                        headers={"authorization": f"Bearer {key}"})
        r.raise_for_status()
open("answer.txt", "w").write(task["q"])
if "log" in task:  # ray_collect_timeline.py: when the agent ran
    with open(task["log"], "a") as f:
        f.write(json.dumps({"start": start, "end": time.time(), "pid": os.getpid()}) + "\n")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_node(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    ray = Path(sys.executable).parent / "ray"
    command = [str(ray), "start", "--block", *args, "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    command += ["--dashboard-agent-listen-port", str(free_port())]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 180
    while b"--block" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"ray start failed: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    return proc


def stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


@dataclass(frozen=True)
class Bench:
    """What the benchmarks run against: a scratch directory (LCAP_HOME and the cwd inside), the agent's script, the
    stand-in upstream's URL and a two-node `ray start` cluster's address."""

    tmp: Path
    agent: Path
    url: str
    address: str


@contextmanager
def two_node_cluster(prefix: str, concurrency: int, latency: float = 0.0) -> Iterator[Bench]:
    """The stand-in upstream (answering each call after `latency` seconds) and a two-node cluster of `concurrency`
    CPUs in all, stopped and removed at the end (a failure's traceback printed first: stopping the nodes ends this
    process, whose Ray client loses the GCS)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["LCAP_HOME"] = str(tmp / "home")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.chdir(tmp)
    agent = tmp / "agent.py"
    agent.write_text(AGENT)
    upstream = subprocess.Popen(
        [sys.executable, "-c", UPSTREAM],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "BENCH_UPSTREAM_DELAY": str(latency)},
    )
    assert upstream.stdout is not None
    url = f"http://127.0.0.1:{upstream.stdout.readline().strip()}"
    per_node = max(1, concurrency // 2)
    port = free_port()
    nodes: list[subprocess.Popen] = []
    try:
        t0 = time.perf_counter()
        head = ["--head", "--port", str(port), "--num-cpus", str(per_node), "--include-dashboard", "false"]
        head += ["--ray-client-server-port", str(free_port()), "--dashboard-port", str(free_port())]
        nodes.append(ray_node(head, tmp / "head.log", dict(os.environ)))
        address = f"127.0.0.1:{port}"
        nodes.append(
            ray_node(["--address", address, "--num-cpus", str(per_node)], tmp / "worker.log", dict(os.environ))
        )
        print(f"two-node cluster up in {time.perf_counter() - t0:.1f} s ({per_node} CPUs each)", flush=True)
        yield Bench(tmp, agent, url, address)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        for node in reversed(nodes):
            stop(node)
        upstream.terminate()
        shutil.rmtree(tmp, ignore_errors=True)


def collect_once(
    db: Path,
    tasks: Path,
    agent: Path,
    round: int,
    args,
    upstream: str,
    address: str | None,
    group: int,
    node_proxies=None,
    command: bool = False,
) -> float:
    """Seconds of one collect of TASKS x GROUP episodes, checked: every episode ok, every call a turn. `command`: run
    as the `lcap collect` command, in a new process."""
    from lcap.dataset.collect.episodes import collect_episodes, load_tasks
    from lcap.dataset.options import CollectOptions
    from lcap.store import Store

    store = Store(db)
    episodes = len(load_tasks(tasks)) * group
    t0 = time.perf_counter()
    if command:
        argv = [str(Path(sys.executable).parent / "lcap"), "collect", "--tasks", str(tasks), "--db", str(db)]
        argv += ["--group-size", str(group), "--concurrency", str(args.concurrency), "--round", str(round)]
        argv += ["--upstream", upstream, "--model", "m", *(["--ray", address] if address else [])]
        done = subprocess.run([*argv, "--", sys.executable, str(agent)], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        assert done.returncode == 0, done.stderr[-2000:]
        (finished,) = store.fetchall("SELECT count(*) FROM episodes WHERE round = ? AND status = 'ok'", [round])[0]
        assert finished == episodes, (finished, episodes)
    else:
        options = CollectOptions(
            group_size=group, concurrency=args.concurrency, round=round, upstream=upstream, model="m", ray=address
        )
        result = collect_episodes(
            store,
            tasks=tasks,
            command=[sys.executable, str(agent)],
            options=options,
            progress=False,
            node_proxies=node_proxies,
        )
        wall = time.perf_counter() - t0
        assert result.finished == episodes, result
    (stored,) = store.fetchall(
        "SELECT count(*) FROM turns WHERE episode_id IN (SELECT episode_id FROM episodes WHERE round = ?)", [round]
    )[0]
    assert stored == episodes * args.calls, (stored, episodes * args.calls)
    return wall


def load() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` prints them."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def make_turn(i: int):
    """A finished chat call of a few hundred bytes each way."""
    from lcap.capture.turns.turn import PendingTurn

    request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi " * 50}]}).encode()
    answer = {"model": "m", "choices": [{"message": {"content": "ok " * 50}, "finish_reason": "stop"}]}
    turn = PendingTurn(
        episode_id=f"e{i % 64}", seq=i, host="api.openai.com", path="/v1/chat/completions", dialect="chat"
    )
    turn.request_body, turn.response_body, turn.status_code = request, json.dumps(answer).encode(), 200
    return turn


def writer_rate(n: int, db: Path) -> float:
    """The baseline: the same turns put straight into a local proxy's writer (no node, no hand-off)."""
    from lcap.capture.storage.writer import TurnWriter
    from lcap.store import Store

    store = Store(db)
    writer = TurnWriter(store)
    writer.start()
    turns = [make_turn(i) for i in range(n)]
    t0 = time.perf_counter()
    for turn in turns:
        writer.put(turn)
    assert writer.flush(timeout=600)
    wall = time.perf_counter() - t0
    writer.finish()
    (stored,) = store.fetchall("SELECT count(*) FROM turns")[0]
    assert stored == n, (stored, n)
    return n / wall


def ingest_rate(n: int, node: str, db: Path) -> float:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from lcap.capture.storage.ingest import Ingest
    from lcap.capture.storage.writer import TurnWriter
    from lcap.dataset.collect.node_proxies import RayOutboxes
    from lcap.store import Store

    key = os.urandom(32)

    class Filler:
        """An Outbox on the worker node holding N finished turns, as a node proxy's would."""

        def __init__(self, n: int, directory: str, key: bytes) -> None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            from lcap.capture.storage.outbox import Outbox

            self.outbox = Outbox(Path(directory), AESGCM(key))
            self.outbox.start()
            for i in range(n):
                self.outbox.put(make_turn(i))

        def ready(self) -> bool:
            return True

        def take(self, after, limit, max_bytes, wait):
            return self.outbox.take(after, limit=limit, max_bytes=max_bytes, wait=wait)

    class Proxies(RayOutboxes):
        """The driver's list of node proxies, here the one filler."""

        def __init__(self, proxy) -> None:
            self.proxy = proxy

        def known(self):
            return {"bench#1": self.proxy}

        def forget(self, key: str) -> None:
            pass  # the ingest stops with an error on a lost node; the run is then invalid

    pinned = NodeAffinitySchedulingStrategy(node, soft=False)
    spool = Path(tempfile.mkdtemp(prefix="lcap-bench-outbox-"))
    filler = (
        ray.remote(Filler)
        .options(num_cpus=0, max_concurrency=4, scheduling_strategy=pinned)
        .remote(n, str(spool / "outbox"), key)
    )
    ray.get(filler.ready.remote())  # filled
    store = Store(db)
    writer = TurnWriter(store)
    writer.start()
    ingest = Ingest(Proxies(filler), writer, key)
    t0 = time.perf_counter()
    ingest.start()
    while ingest.records < n:
        if ingest.error is not None:
            raise SystemExit(f"ingest failed: {ingest.error}")
        time.sleep(0.01)
    assert ingest.settle(timeout=300)
    wall = time.perf_counter() - t0
    ingest.stop()
    writer.finish()
    (stored,) = store.fetchall("SELECT count(*) FROM turns")[0]
    assert stored == n, (stored, n)
    ray.kill(filler)
    shutil.rmtree(spool, ignore_errors=True)
    return n / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64", help="episodes per collect, comma-separated")
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds the upstream takes to answer each call")
    parser.add_argument("--ingest", type=int, default=20000)
    args = parser.parse_args()

    sizes = [int(size) for size in args.sizes.split(",")]
    with two_node_cluster("lcap-bench-ray-", args.concurrency, args.latency) as bench:
        tmp, agent, url, address = bench.tmp, bench.agent, bench.url, bench.address
        one_task = tmp / "one-task.jsonl"
        one_task.write_text(json.dumps({"id": "one", "q": "q", "calls": args.calls}) + "\n")

        from lcap.dataset.collect.on_ray import NodeProxies
        from lcap.store import Store

        # (name, Ray address, how: "pool" in this process, "kept" node proxies, "command" a new process)
        paths: list[tuple[str, str | None, str]] = [
            ("local pool", None, "pool"),
            ("ray, proxies per collect", address, "pool"),
            ("ray, proxies kept", address, "kept"),
            ("lcap collect", None, "command"),
            ("lcap collect --ray", address, "command"),
        ]
        print(
            f"{args.group} samples x {args.calls} calls per episode, upstream latency {args.latency:g} s, "
            f"concurrency {args.concurrency}, {args.rounds} rounds"
        )
        for size in sizes:
            tasks = tmp / f"tasks-{size}.jsonl"
            n_tasks = max(1, size // args.group)
            tasks.write_text(
                "".join(json.dumps({"id": f"t{i}", "q": f"q{i}", "calls": args.calls}) + "\n" for i in range(n_tasks))
            )
            episodes = n_tasks * args.group
            rates: dict[str, list[float]] = {name: [] for name, _, _ in paths}
            single: dict[str, list[float]] = {name: [] for name, _, _ in paths}
            baseline = {name: "lcap collect" if how == "command" else "local pool" for name, _, how in paths}
            before = load()
            kept: dict[str, NodeProxies] = {}
            try:
                for round in range(args.rounds + 1):  # round 0 warms every path up (Ray's workers, kept proxies)
                    for name, where, how in paths:
                        db = tmp / f"{size}-{name.replace(' ', '-').replace(',', '')}.duckdb"
                        proxies = kept.setdefault(name, NodeProxies(Store(db))) if how == "kept" else None
                        command = how == "command"
                        wall = collect_once(db, tasks, agent, round, args, url, where, args.group, proxies, command)
                        one = collect_once(db, one_task, agent, 1000 + round, args, url, where, 1, proxies, command)
                        if round:
                            rates[name].append(episodes / wall)
                            single[name].append(one)
            finally:
                for proxies in kept.values():
                    proxies.close()
            print(f"\n{episodes} episodes per collect; load average before {before}, after {load()}")
            print(
                f"{'path':<26} {'episodes/s median':>18} {'min':>6} {'max':>6} {'/ local':>8} "
                f"{'one-episode collect s':>22}"
            )
            for name, values in rates.items():
                print(
                    f"{name:<26} {statistics.median(values):>18.2f} {min(values):>6.2f} {max(values):>6.2f} "
                    f"{statistics.median(values) / statistics.median(rates[baseline[name]]):>7.2f}x "
                    f"{statistics.median(single[name]):>22.1f}"
                )
        print("target: ray >= 0.8x the local pool")

        import ray

        worker = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" not in n["Resources"]]
        remote = ingest_rate(args.ingest, worker[0], tmp / "ingest.duckdb")
        local = writer_rate(args.ingest, tmp / "writer.duckdb")
        print(f"\nstore ingest, {args.ingest} turns     turns/s")
        print(f"{'from a remote node':<28} {remote:>9,.0f}  (target >= 3,000)")
        print(f"{'local, the same writer':<28} {local:>9,.0f}  (the same writer, no hand-off)")
        ray.shutdown()


if __name__ == "__main__":
    main()
