"""The demo's control: the base model and the last served round again on the held-out tasks, greedy (temperature 0).

A sampled held-out figure rises both when the policy learns and when it only grows surer of what it already
answered (lower sampling entropy); greedy decoding takes the second away, so a gain that holds at temperature 0 is
one of the first kind. Both are measured by `lcap eval`'s own machinery (loop/evaluate.py `run_eval`: a collect of
split `compare` per deployment, labelled `eval` LABEL and `deployment`), so they are stored as any `lcap eval` is,
and the summary reads them back from the store with `lcap eval`'s figures (`evaluate.summarise`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lcap.config import LcapError
from lcap.display import num
from lcap.loop.evaluate import EvalRow, plain, run_eval, summarise
from lcap.loop.options import EvalOptions
from lcap.loop.steps import LoopConfig, tasks_root
from lcap.policy import read_policy

LABEL = "demo-greedy"  # the `eval` label of the control's episodes

# Each deployment's latest greedy collect of the demo, in the order it ran.
_RUNS_SQL = """
SELECT labels->>'deployment' AS deployment, arg_max(labels->>'collect', started_at) AS run, arg_max(round, started_at)
FROM episodes WHERE split = 'compare' AND labels->>'eval' = ? GROUP BY deployment ORDER BY min(started_at)
"""


def run_greedy(store, config: LoopConfig, echo: Callable[[str], None], *, base_only: bool = False) -> list[EvalRow]:
    """Evaluate the base model and the deployment serving now (the last promoted round) greedily, one sample per
    held-out task, on the running policy server; a deployment already evaluated (a resumed demo) is not run again.
    `base_only`: the base model alone, and only while it serves (before a loop whose deploys replace its weights)."""
    record = read_policy()
    if record is None or config.eval_tasks is None:
        raise LcapError("the demo's greedy control needs the policy server and the held-out tasks")
    if config.options.per_role:  # a round is one adapter per role: `lcap eval` names one deployment for every call
        echo("[demo] greedy control: not for a --per-role demo (lcap eval serves every role one deployment)")
        return greedy_rows(store)
    done = {row.deployment for row in greedy_rows(store)}
    base_serves = not record.served_as and record.current == record.served_model
    wanted = list(dict.fromkeys([record.served_model, record.current]))
    if base_only:
        wanted = wanted[:1] if base_serves else []
    elif record.served_as:  # the base's weights were replaced in place (--deploy-merge, --full)
        if record.served_model not in done:
            echo(
                "[demo] greedy control: the base model's weights no longer serve (a merged or full checkpoint "
                f"replaced them): {record.current} only"
            )
        wanted = [record.current]
    todo = tuple(name for name in wanted if name not in done)
    if todo:
        echo(f"[demo] greedy control: {', '.join(todo)} at temperature 0 on the held-out tasks")
        run_eval(
            store,
            tasks=config.eval_tasks,
            command=config.command,
            options=EvalOptions(deployments=todo, samples=1, label=LABEL),
            collect=replace(  # held-out tasks: scored as the loop's held-out episodes are (--reward judge: exactly)
                config.collect,
                run_dir=config.run / "episodes",
                tasks_root=tasks_root(config),
                verifier=config.eval_verifier or config.collect.verifier,
            ),
            proxy=replace(config.proxy, temperature=0.0),
            echo=echo,
        )
    return greedy_rows(store)


def greedy_rows(store) -> list[EvalRow]:
    """The control's figures, from the store: `lcap eval`'s row of each deployment's latest greedy collect."""
    return [summarise(store, name, run, round, 1) for name, run, round in store.fetchall(_RUNS_SQL, [LABEL])]


def greedy_summary(store) -> dict:
    """The control for the demo's summary: its rows (as `lcap eval --out` writes them, each with the round it is:
    0 for the base model), a Markdown table and a line."""
    rows = []
    for row in greedy_rows(store):
        kinds = store.fetchall(_KIND_SQL, [row.deployment])
        kind, round = kinds[0] if kinds else (None, None)
        rows.append({**plain(row), "of_round": 0 if kind == "base" else round})
    if not rows:
        return {"rows": [], "markdown": "", "line": ""}
    said = lambda r: "base" if r["of_round"] == 0 else f"round {r['of_round']}"  # noqa: E731
    table = [
        "| greedy (temperature 0) | deployment | held-out tasks | right | mean reward (95% interval) |",
        "|---|---|---|---|---|",
    ] + [
        f"| {said(r)} | {r['deployment']} | {r['tasks']} | {num(r['right'])} | {num(r['mean_reward'])} "
        f"({num(r['low'])} to {num(r['high'])}) |"
        for r in rows
    ]
    line = "greedy (temperature 0) right answers: " + " -> ".join(f"{said(r)} {num(r['right'], 2)}" for r in rows)
    return {"rows": rows, "markdown": "\n".join(table), "line": line}


_KIND_SQL = "SELECT kind, round FROM deployments WHERE name = ? ORDER BY created_at DESC LIMIT 1"
