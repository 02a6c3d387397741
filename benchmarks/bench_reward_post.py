"""Where a reward POST's time goes while a serving proxy stores traffic and `lcap loop --live` waits for a batch.

    .venv/bin/python benchmarks/bench_reward_post.py [--seconds 60] [--agents 4] [--posters 2]

One `lcap proxy --serve` (in this process, so that the reward endpoint's phases can be timed; its turn writer is
its own process, as always) in front of a fake upstream that answers with token ids; AGENTS threads each run
sessions of two chat calls under `X-Lcap-Session`, back to back; a second process polls the store for ready
episodes every 2 s, as `lcap loop --live` does while it waits for a batch (`ready_episodes`); POSTERS threads
post one reward per finished session (and one for a session that never ran, in ten) to the reward endpoint.
Printed: the posts' latency (median, 90th percentile, longest) by answer, and the reward store thread's time
per phase (the lookup of the episode, the wait for the episode rows in flight before a 404, the reward's
insert) with, inside them, the time spent waiting to attach the store file. With --hold S, one more process
attaches the store and holds it S seconds, again and again: a turn writer whose batches a loaded machine slows
(the writer runs niced).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

KEY = "sk-bench-tenant-0123456789"


def poller(db: str, stop, out) -> None:
    """`lcap loop --live`'s batch wait: the ready query every POLL_S."""
    from lcap.loop.live import POLL_S, ready_episodes
    from lcap.store import Store

    store, took = Store(db), []
    while not stop.is_set():
        t = time.perf_counter()
        ready_episodes(store, ["m"])
        took.append(time.perf_counter() - t)
        stop.wait(POLL_S)
    out.put(took)


def holder(db: str, hold: float, stop, out) -> None:
    """A turn writer starved of CPU: it holds the store file HOLD seconds a batch, and attaches again at once."""
    from lcap.store import Store

    store, holds = Store(db), 0
    while not stop.is_set():
        with store.connect():
            time.sleep(hold)
        holds += 1
    out.put(holds)


def _q(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    return {
        "n": len(values),
        "p50": round(statistics.median(values), 3),
        "p90": round(values[int(0.9 * (len(values) - 1))], 3),
        "max": round(values[-1], 3),
        "sum": round(sum(values), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--posters", type=int, default=2)
    ap.add_argument("--hold", type=float, default=0.0, help="a process holds the store this long, again and again")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lcap-bench-rewards-"))
    os.environ["LCAP_HOME"] = str(tmp / "home")
    from fixtures_capture import FakeLLM

    from lcap.capture.options import ProxyOptions
    from lcap.capture.proxy import rewards_api
    from lcap.capture.run import _start
    from lcap.store import Store

    phases: dict[str, list[float]] = {}

    def timed(name: str, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if threading.current_thread().name.startswith("lcap-rewards"):
                    phases.setdefault(name, []).append(time.perf_counter() - t)

        return wrapper

    Store._while_locked = timed("attach (inside the phases)", Store._while_locked)  # type: ignore[method-assign]
    endpoint = rewards_api.RewardEndpoint
    endpoint._episode = timed("lookup", endpoint._episode)  # type: ignore[method-assign]
    endpoint._store = timed("whole store-thread batch", endpoint._store)  # type: ignore[method-assign]
    original_init = endpoint.__init__

    def init(self, *a, **k):
        original_init(self, *a, **k)
        self.settle = timed("settle (rows in flight, before a 404)", self.settle)
        self.store = _TimedStore(self.store, timed)

    endpoint.__init__ = init  # type: ignore[method-assign]
    llm = FakeLLM(vllm=True)
    threading.Thread(target=llm.serve_forever, daemon=True).start()
    db = tmp / "lcap.duckdb"
    proxy = _start(
        Store(db),
        ProxyOptions(
            upstream=f"http://127.0.0.1:{llm.server_port}",
            rewards_port=0,
            require_credentials=False,
            conversations=True,
        ),
    )
    assert proxy.rewards is not None
    url, port = proxy.rewards.url, proxy.port
    finished: queue.Queue[str] = queue.Queue()
    stop = threading.Event()
    latency: dict[int, list[float]] = {}
    lock = threading.Lock()

    def agent(a: int) -> None:
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", timeout=120) as client:
            i = 0
            while not stop.is_set():
                session = f"a{a}-{i}"
                messages = [{"role": "user", "content": f"hello {session}"}]
                for _ in range(2):
                    r = client.post(
                        f"http://127.0.0.1:{llm.server_port}/v1/chat/completions",
                        json={"model": "m", "messages": messages},
                        headers={"Authorization": f"Bearer {KEY}", "X-Lcap-Session": session},
                    )
                    r.raise_for_status()
                    messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
                finished.put(session)
                if i % 10 == 0:
                    finished.put(f"ghost-{session}")
                i += 1

    def poster() -> None:
        with httpx.Client(timeout=300) as client:
            while not stop.is_set() or not finished.empty():
                try:
                    session = finished.get(timeout=0.5)
                except queue.Empty:
                    continue
                t = time.perf_counter()
                status = client.post(
                    url,
                    json={"session": session, "value": 1.0, "key": session},
                    headers={"Authorization": f"Bearer {KEY}"},
                ).status_code
                with lock:
                    latency.setdefault(status, []).append(time.perf_counter() - t)

    ctx = mp.get_context("spawn")
    poll_stop, poll_out = ctx.Event(), ctx.Queue()
    polling = ctx.Process(target=poller, args=(str(db), poll_stop, poll_out))
    polling.start()
    holding = ctx.Process(target=holder, args=(str(db), args.hold, poll_stop, poll_out)) if args.hold else None
    if holding is not None:
        holding.start()
    threads = [threading.Thread(target=agent, args=(a,)) for a in range(args.agents)]
    threads += [threading.Thread(target=poster) for _ in range(args.posters)]
    for thread in threads:
        thread.start()
    time.sleep(args.seconds)
    stop.set()
    for thread in threads[: args.agents]:
        thread.join()
    for thread in threads[args.agents :]:
        thread.join()
    poll_stop.set()
    got = [poll_out.get(timeout=120) for _ in range(2 if holding is not None else 1)]
    polls = next(g for g in got if isinstance(g, list))
    polling.join()
    if holding is not None:
        holding.join()
    proxy.stop()
    report = {
        "seconds": args.seconds,
        "agents": args.agents,
        "posters": args.posters,
        "hold_s": args.hold,
        "load": os.getloadavg()[0],
        "post_latency_s": {str(k): _q(v) for k, v in sorted(latency.items())},
        "store_thread_phases_s": {k: _q(v) for k, v in sorted(phases.items())},
        "ready_query_s": _q(polls),
        "turns": Store(db).fetchall("SELECT count(*) FROM turns")[0][0],
    }
    print(json.dumps(report, indent=2))


class _TimedStore:
    """The endpoint's store, with its reward insert timed."""

    def __init__(self, store, timed) -> None:
        self._store = store
        self.add_reward = timed("insert", store.add_reward)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


if __name__ == "__main__":
    main()
