"""A two-role agent (openai SDK, chat completions), as a user would write it for a small model: a planner turns a
word problem into an arithmetic expression, a solver works it out with a calculator tool.

    python planner_solver.py --problem "A crate holds 61 bottles. How many bottles are in 65 crates?"

Each role is one system prompt of the same agent, with its own worked examples in the history, as agent authors
write few-shot prompts for a small model. The planner's reply `Expression: <expression>` is printed, then the
solver's calls (calculator's tool loop) and its answer `Answer: <number>`, printed last. It calls
https://api.openai.com with OPENAI_API_KEY and knows nothing of lcap: a proxy tells the roles apart by their system
prompts (`--role-by 'system:^You are the planner=planner'`).
"""

import argparse
import importlib.util
import os
import re
from pathlib import Path

from openai import OpenAI


def _calculator_agent():
    """calculator.py beside this file: the solver is its tool loop, with its tool and worked examples."""
    spec = importlib.util.spec_from_file_location("calculator_agent", Path(__file__).with_name("calculator.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_calc = _calculator_agent()
tool_loop, worked_example = _calc.tool_loop, _calc.worked_example

PLANNER = (
    "You are the planner. Read the word problem and write the arithmetic expression that answers it, "
    "as: Expression: <expression>"
)
SOLVER = "You are the solver. Use the calculator tool for arithmetic, then give the result as: Answer: <number>"
# The planner's worked examples, (problem, expression), and the solver's, (a, b): the task set never asks these numbers.
PLANS = (
    ("A box holds 23 pens. How many pens are in 47 boxes?", "23 * 47"),
    ("81 children each bring 16 apples. How many apples do they bring?", "81 * 16"),
    ("A book has 58 pages. How many pages are in 34 books?", "58 * 34"),
)
SOLVES = (*_calc.EXAMPLES, (58, 34))
EXPRESSION = re.compile(r"Expression:\s*(.+)")


def plan(client: OpenAI, args: argparse.Namespace) -> str:
    """The planner's call: the expression it wrote (its reply's first line when it left out `Expression:`)."""
    messages = [{"role": "system", "content": PLANNER}]
    for problem, expression in PLANS:
        messages += [
            {"role": "user", "content": problem},
            {"role": "assistant", "content": f"Expression: {expression}"},
        ]
    messages.append({"role": "user", "content": args.problem})
    reply = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.plan_tokens, temperature=args.temperature
    )
    said = (reply.choices[0].message.content or "").strip()
    m = EXPRESSION.search(said)
    return (m.group(1) if m else said).strip().splitlines()[0].strip() if said else ""


def solve(client: OpenAI, expression: str, args: argparse.Namespace) -> str:
    """The solver's calls (a tool call, the answer): its last reply."""
    messages = [{"role": "system", "content": SOLVER}]
    for n, (a, b) in enumerate(SOLVES):
        messages += worked_example(a, b, n)
    messages.append({"role": "user", "content": f"What is {expression}?"})
    return tool_loop(client, messages, args)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", required=True)
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))
    ap.add_argument("--turns", type=int, default=3, help="the solver's calls to the model at most")
    ap.add_argument("--plan-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()

    client = OpenAI()
    expression = plan(client, args)
    print(f"Expression: {expression}")
    print(solve(client, expression, args))


if __name__ == "__main__":
    main()
