"""The demo's verifier: reward 1 when the agent printed exactly the task's answer, else 0.

As a Python verifier (`--verifier scripts/demo/verify.py:verify`, no process per episode) or as a
command (`--verifier "python scripts/demo/verify.py"`: task in LCAP_TASK, agent stdout on stdin).
"""

import json
import os
import sys


def score(answer: str, stdout: str) -> dict:
    lines = [line.strip() for line in stdout.strip().splitlines() if line.strip()]
    said = lines[-1] if lines else ""
    return {"reward": float(said == answer), "said": said, "expected": answer}


def verify(ctx) -> dict:
    return score(str(ctx.task["answer"]), ctx.stdout)


if __name__ == "__main__":
    task = json.loads(os.environ["LCAP_TASK"])
    print(json.dumps(score(str(task["answer"]), sys.stdin.read())))
