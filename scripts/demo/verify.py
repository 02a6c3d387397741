"""The demo's verifier: a format reward plus an accuracy reward, as in R1-style RL recipes.

The answer must be the last line of the agent's output, written `Answer: <word>`:
0.5 for a well-formed answer, 1.0 for a well-formed right one, 0 for anything else (an answer the
verifier cannot parse is worth nothing, however right it may be).

As a Python verifier (`--verifier scripts/demo/verify.py:verify`, no process per episode) or as a
command (`--verifier "python scripts/demo/verify.py"`: task in LCAP_TASK, agent stdout on stdin).
"""

import json
import os
import re
import sys

ANSWER = re.compile(r"^Answer: (\S+)$")


def score(expected: str, stdout: str) -> dict:
    lines = [line.strip() for line in stdout.strip().splitlines() if line.strip()]
    said = lines[-1] if lines else ""
    m = ANSWER.match(said)
    right = bool(m) and m.group(1) == expected
    return {
        "reward": 1.0 if right else 0.5 if m else 0.0,
        "well_formed": bool(m),
        "right": right,
        "said": said,
        "expected": expected,
    }


def verify(ctx) -> dict:
    return score(str(ctx.task["answer"]), ctx.stdout)


if __name__ == "__main__":
    task = json.loads(os.environ["LCAP_TASK"])
    print(json.dumps(score(str(task["answer"]), sys.stdin.read())))
