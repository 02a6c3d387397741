"""The roles demo's verifier (`lcap demo --task roles`): the shared verifier's reward on the episode's answer, and
each role's own success in the details.

The agent (scripts/agents/planner_solver.py) prints the planner's `Expression: <expression>`, then the solver's
`Answer: <number>` last. The reward is verify.py's on the answer (1.0 right, 0.5 well-formed, 0 else), shared by
both roles. The details add `planner_right` (the expression evaluates to the task's answer) and `solver_right`
(the answer is what the planner's expression evaluates to, right or wrong; None when it evaluates to nothing, so
the solver had no question to get right).
"""

import importlib.util
import re
from pathlib import Path
from types import ModuleType

EXPRESSION = re.compile(r"^Expression: (.*)$")


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_HERE = Path(__file__).resolve().parent
_verify = _load(_HERE / "verify.py", "lcap_demo_verify")
_calculate = _load(_HERE.parent / "agents" / "calculator.py", "lcap_demo_calculator_tool").calculate


def score(expected: str, stdout: str) -> dict:
    details = _verify.score(expected, stdout)
    lines = [line.strip() for line in stdout.splitlines()]
    expression = next((m.group(1).strip() for line in lines if (m := EXPRESSION.match(line))), None)
    value = _calculate(expression) if expression else "error: no expression"
    measurable = not value.startswith("error")
    said = _verify.ANSWER.match(details["said"])
    return {
        **details,
        "expression": expression,
        "planner_right": value == expected,
        "solver_right": (bool(said) and said.group(1) == value) if measurable else None,
    }


def verify(ctx) -> dict:
    return score(str(ctx.task["answer"]), ctx.stdout)
