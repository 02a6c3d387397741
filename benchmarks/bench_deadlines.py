"""A deadline per wait as the front sets them (one `Watch` per connection) against `asyncio.timeout`, side by side.

    .venv/bin/python benchmarks/bench_deadlines.py [--waits 200000] [--rounds 5]

On uvloop, as the proxy runs, TASKS tasks (1, then 256: connections) each wait WAITS / TASKS times for
something that is ready on the loop's next turn (`asyncio.sleep(0)`), the paths in a new random order each
round:
- bare: the wait with no deadline, the floor;
- Watch: each wait inside `with watch.within(30, ...)`, the task's own `Watch` (capture/proxy/connections.py),
  `Watches` ticking as in the proxy;
- asyncio.timeout: each wait inside `async with asyncio.timeout(30)`, which schedules and cancels a loop timer.
The front puts a deadline on every wait: several per call, two per chunk of a stream. Printed per round and as
medians: time per wait, and what the deadline adds to it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import uvloop

from lcap.capture.proxy.connections import Watches


async def bare(watches: Watches, n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def watched(watches: Watches, n: int) -> None:
    task = asyncio.current_task()
    assert task is not None
    watch = watches.add(task)
    try:
        for _ in range(n):
            with watch.within(30, "wait"):
                await asyncio.sleep(0)
    finally:
        watches.active.discard(watch)


async def timed_out(watches: Watches, n: int) -> None:
    for _ in range(n):
        async with asyncio.timeout(30):
            await asyncio.sleep(0)


PATHS: dict[str, Callable[[Watches, int], Awaitable[None]]] = {
    "bare": bare,
    "Watch": watched,
    "asyncio.timeout": timed_out,
}


async def one_run(path: Callable[[Watches, int], Awaitable[None]], tasks: int, waits: int) -> float:
    """Seconds per wait with `tasks` tasks waiting `waits` times in all."""
    watches = Watches()
    watches.start(asyncio.get_running_loop())
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(path(watches, waits // tasks) for _ in range(tasks)))
        return (time.perf_counter() - t0) / (waits // tasks * tasks)
    finally:
        watches.stop()


async def bench(waits: int, rounds: int) -> None:
    for tasks in (1, 256):
        per: dict[str, list[float]] = {name: [] for name in PATHS}
        await one_run(timed_out, tasks, waits // 10)  # warm-up
        for number in range(rounds):
            order = list(PATHS)
            random.shuffle(order)
            for name in order:
                per[name].append(await one_run(PATHS[name], tasks, waits) * 1e9)
            print(f"{tasks:>5} tasks, round {number}: " + ", ".join(f"{n} {per[n][-1]:.0f} ns" for n in PATHS))
        m = {name: statistics.median(values) for name, values in per.items()}
        watch, timeout = m["Watch"] - m["bare"], m["asyncio.timeout"] - m["bare"]
        print(
            f"{tasks:>5} tasks, medians: bare {m['bare']:.0f} ns a wait; a Watch adds {watch:.0f} ns, "
            f"asyncio.timeout adds {timeout:.0f} ns ({timeout / watch:.1f}x); "
            f"the wait with its deadline {m['asyncio.timeout'] / m['Watch']:.2f}x as long with asyncio.timeout",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waits", type=int, default=200_000, help="waits per path per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(bench(args.waits, args.rounds))


if __name__ == "__main__":
    main()
