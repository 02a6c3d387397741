"""Python verifiers: `--verifier scripts/verifiers/python_verifiers.py:FUNCTION`.

lcap calls the function with a context (task, episode_id, workdir, stdout, exit_code) and stores
what it returns: a float, (reward, details), or {"reward": ..., ...}.
"""

import subprocess
import sys


def answer_length(ctx):
    """Reward in [0, 1]: how close the answer is to the task's `target_chars` (default 20) characters."""
    target = int(ctx.task.get("target_chars", 20))
    answer = (ctx.workdir / "answer.txt").read_text() if (ctx.workdir / "answer.txt").exists() else ctx.stdout
    return max(0.0, 1.0 - abs(len(answer.strip()) - target) / max(target, 1)), {"chars": len(answer.strip())}


def run_tests(ctx):
    """Reward 1 when the task's tests (tests/ in the workdir) pass; the agent must not edit them."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests"], cwd=ctx.workdir, capture_output=True, text=True, timeout=300
    )
    return {"reward": 1.0 if proc.returncode == 0 else 0.0, "pytest_exit": proc.returncode}


run_tests.protected = ["tests/**"]  # hashed before and after the episode: an edit zeroes the reward
