"""`lcap demo --task roles`: two roles of one agent, a planner and a solver, each trained an adapter of its own.

The agent is scripts/agents/planner_solver.py, an OpenAI-SDK agent with two system prompts: the planner turns a
word problem into an arithmetic expression, the solver (calculator.py's tool loop) works it out with the calculator
tool and answers. It sends no lcap header: the loop's proxy tells its calls apart by their system prompts
(`--role-by system:^You are the planner=planner`, `system:^You are the solver=solver`), and `lcap loop --per-role`
trains each role's adapter on its own calls, the episode's reward shared:

    planner  "A crate holds 61 bottles. How many bottles are in 65 crates?"  ->  Expression: 61 * 65
    solver   What is 61 * 65?  ->  <tool_call>{"name": "calculator", ...}</tool_call>  tool: "3965"  ->  Answer: 3965

The verifier (scripts/demo/verify_roles.py) rewards the answer as the shared verifier does, and tells each role's own
success apart: the planner's expression evaluates to the task's answer; the solver's answer is what the planner's
expression evaluates to (measurable where it evaluates at all). The demo reports both per round, beside the whole
episode's right answers, which its bar (the gain over the base) is measured on.
"""

from __future__ import annotations

from pathlib import Path

from lcap.dataset import FINISHED
from lcap.loop.demo.task import DemoTask, bundled_agent, load_script, pair_tasks, script_command

# The problems: a product of two two-digit numbers told in words (the planner's job is to see the product).
PROBLEMS = (
    "A crate holds {a} bottles. How many bottles are in {b} crates?",
    "{a} workers each plant {b} trees. How many trees do they plant?",
    "A train has {a} cars with {b} seats each. How many seats does it have?",
    "A farmer has {a} rows of {b} plants. How many plants does the farmer have?",
    "Each of {a} shelves holds {b} books. How many books are on the shelves?",
    "A ticket costs {a} dollars. How much do {b} tickets cost?",
)
LOW, HIGH = 12, 99  # the numbers: two digits, past what the model multiplies by heart
TURNS = 3  # the solver's calls at most: a tool call, the answer, one more if the model calls again
MAX_TOKENS = 40  # per solver call: a calculator call is about 30 tokens
PLAN_TOKENS = 16  # the planner's call: `Expression: 61 * 65` is about 10
ROLE_BY = ("system:^You are the planner=planner", "system:^You are the solver=solver")

# Per held-out round, from the store: each role's success (the verifier's details) beside the episode's.
_BY_ROLE = f"""
SELECT round, count(*) AS episodes,
       avg(coalesce((reward_details->>'planner_right')::BOOLEAN, false)::INTEGER) AS planner,
       avg(((reward_details->>'solver_right')::BOOLEAN)::INTEGER) AS solver,
       count(reward_details->>'solver_right') AS solver_measured,
       avg(coalesce((reward_details->>'right')::BOOLEAN, false)::INTEGER) AS episode
FROM episode_summary
WHERE split = 'eval' AND status IN {FINISHED}
GROUP BY round ORDER BY round
"""


def agent_path() -> Path:
    return bundled_agent("planner_solver.py")


def agent_command() -> list[str]:
    return script_command(
        agent_path(), problem="{problem}", turns=TURNS, max_tokens=MAX_TOKENS, plan_tokens=PLAN_TOKENS
    )


def make_tasks(words: list[str], *, n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct number pairs, none of the agent's worked examples' (`pair_tasks`), each told by one of the problems.
    `words` is the tiny tasks' word list, unused here."""
    seen = {tuple(sorted(p)) for p in load_script(agent_path(), "lcap_demo_planner_solver_agent").SOLVES}
    return pair_tasks(
        seen,
        lambda rng, a, b: {"problem": rng.choice(PROBLEMS).format(a=a, b=b), "answer": str(a * b)},
        n_train=n_train,
        n_eval=n_eval,
        seed=seed,
        low=LOW,
        high=HIGH,
    )


def report(store) -> dict:
    """Held-out success per role and per episode, each round (`by_round`), and the line that says first -> last."""
    names = ("round", "episodes", "planner", "solver", "solver_measured", "episode")
    rows = [dict(zip(names, r, strict=True)) for r in store.fetchall(_BY_ROLE)]
    if not rows:
        return {"by_round": [], "line": "[demo] held-out per role: no held-out round in the store"}
    first, last = rows[0], rows[-1]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    line = (
        f"[demo] held-out per role (round {first['round']} -> {last['round']}): planner's expression right "
        f"{fmt(first['planner'])} -> {fmt(last['planner'])}; solver's answer = its expression's value "
        f"{fmt(first['solver'])} -> {fmt(last['solver'])} (of {first['solver_measured']} -> "
        f"{last['solver_measured']} episodes with an expression that evaluates); whole episode right "
        f"{fmt(first['episode'])} -> {fmt(last['episode'])}"
    )
    return {"by_round": rows, "line": line}


TASK = DemoTask(
    "roles",
    agent_command,
    make_tasks,
    corpus=None,
    model="smollm2",
    verifier="verify_roles.py",
    role_by=ROLE_BY,
    report=report,
    defaults={  # calculator's (loop/demo/calculator.py): the solver is its agent, the planner one short call more
        "rounds": 3,
        "n_train": 64,
        "tasks_per_round": 8,
        "group_size": 8,
        "n_eval": 64,
        "eval_group_size": 1,
        "concurrency": 8,
        "lr": 1e-4,
        "epochs": 1,
        "epsilon_high": 0.28,
        "batch_size": 16,
        "activation_checkpointing": True,
    },
)
