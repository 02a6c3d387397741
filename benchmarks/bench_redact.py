"""What redaction costs the writer per turn, and why its rules are found by their literals.

    .venv/bin/python benchmarks/bench_redact.py [--rounds 30]

Times, interleaved round by round on the same text (a chat request of prose and code, 8 KB and 70 KB, as
an agent's context grows): lcap's `redact_keys` (each rule tried where its literal occurs), the same rules
as one alternation regex (the obvious design), and `build_row` of a whole turn with that request, the
writer's work per turn, redaction included. Prints the median microseconds of each.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

from lcap import redact
from lcap.capture.turns.turn import PendingTurn, build_row

REPO = Path(__file__).resolve().parents[1]


def request(size: int) -> str:
    text = "".join(p.read_text() for p in sorted((REPO / "capture").glob("*.py"))) * 4
    messages, at = [], 0
    while len(json.dumps(messages)) < size:
        messages.append({"role": "user" if len(messages) % 2 == 0 else "assistant", "content": text[at : at + 1500]})
        at += 1500
    return json.dumps({"model": "gpt-4o", "messages": messages}, ensure_ascii=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    one_regex = re.compile("|".join(f"(?:{rule.replace('?P<keep>', '?:')})" for _, _, rule in redact._RULES))
    answer = json.dumps({"model": "m", "choices": [{"message": {"content": "ok " * 100}, "finish_reason": "stop"}]})
    print(f"{'request':>8}  {'redact_keys us':>15}  {'one regex us':>13}  {'build_row us':>13}")
    for size in (8_000, 70_000):
        body = request(size)
        turn = PendingTurn(episode_id="e", seq=0, host="api.openai.com", path="/v1/chat/completions", dialect="chat")
        turn.request_body, turn.response_body, turn.status_code = body.encode(), answer.encode(), 200
        cases = {
            "lcap": lambda: redact.redact_keys(body),
            "one regex": lambda: one_regex.sub(redact.REDACTED, body),
            "build_row": lambda: build_row(turn),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, case in cases.items():
                t0 = time.perf_counter()
                case()
                times[name].append((time.perf_counter() - t0) * 1e6)
        med = {name: statistics.median(values) for name, values in times.items()}
        print(f"{len(body):>8}  {med['lcap']:>15.0f}  {med['one regex']:>13.0f}  {med['build_row']:>13.0f}")


if __name__ == "__main__":
    main()
