"""Verifier command: reward 1.0 when the agent's output contains the task's `answer`, else 0.0.

    lcap collect --verifier "python scripts/verifiers/contains_answer.py" ...

Reads the task from LCAP_TASK and the agent's stdout from stdin; prints a JSON object with the
reward and the details lcap stores next to it.
"""

import json
import os
import sys

task = json.loads(os.environ["LCAP_TASK"])
output = sys.stdin.read()
expected = str(task.get("answer", ""))
hit = bool(expected) and expected.lower() in output.lower()
print(json.dumps({"reward": 1.0 if hit else 0.0, "expected": expected, "output_chars": len(output)}))
