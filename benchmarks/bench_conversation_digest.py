"""How long one huge call holds the proxy's event loop while `--conversations` places it: lcap's limit vs none.

    .venv/bin/python benchmarks/bench_conversation_digest.py [--messages 3000000] [--repeats 3]

`Sessions.by_body` runs on the proxy's event loop, so every other agent's call waits as long as it takes. One call
of `--messages` small chat messages (a 5 MiB body holds three million) is placed with lcap's
MAX_CONVERSATION_ITEMS (not digested past it) and with the limit lifted (every prefix digested, as before); a call
of exactly the limit shows the most a call under it costs. Prints the worst seconds of each arm over the repeats.
"""

from __future__ import annotations

import argparse
import time

from lcap.capture.proxy import sessions


def _seconds(request: dict, limit: int) -> float:
    sessions.MAX_CONVERSATION_ITEMS = limit
    placed = sessions.Sessions(conversations=True)
    start = time.perf_counter()
    placed.by_body("chat", request, "tenant")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    limit = sessions.MAX_CONVERSATION_ITEMS
    huge = {"messages": [{"role": "user", "content": "x"}] * args.messages}
    at_limit = {"messages": [{"role": "user", "content": "x"}] * limit}
    arms = {
        f"{args.messages:,} messages, limit {limit:,}": (huge, limit),
        f"{args.messages:,} messages, no limit": (huge, args.messages + 1),
        f"{limit:,} messages (the most digested)": (at_limit, limit),
    }
    worst = {name: 0.0 for name in arms}
    for _ in range(args.repeats):  # the arms alternate, so a busy machine slows each alike
        for name, (request, cap) in arms.items():
            worst[name] = max(worst[name], _seconds(request, cap))
    sessions.MAX_CONVERSATION_ITEMS = limit
    for name, seconds in worst.items():
        print(f"{name:45s} event loop held {seconds:8.3f} s (worst of {args.repeats})")


if __name__ == "__main__":
    main()
