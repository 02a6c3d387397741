"""`lcap demo --reward judge`: the calculator demo trained on an LLM judge's rewards only.

The judge is the policy server's base weights (the judge's default endpoint: no adapter, so the policy being
trained never judges itself), scoring each training episode pointwise against the bundled rubric
(scripts/demo/judge_rubric.md), which gives it the task's right answer as its `reference`. The held-out episodes
stay rewarded by the exact verifier (scripts/demo/verify.py): the demo measures whether the judge's rewards taught
the exact skill. So that the exact verifier only measures, every round's adapter is promoted (the held-out result
gates nothing); and once the loop is done each training episode is labelled with the exact verifier's verdict
(`exact_right`, `exact_reward`), never a reward, so the summary can give the judge's agreement with it per round.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from lcap.config import LcapError
from lcap.loop.demo.task import DemoTask, demo_dir, load_script
from lcap.loop.options import LoopOptions
from lcap.loop.steps import LoopConfig
from lcap.store import Store

RUBRIC = "judge_rubric.md"  # bundled with the demo (scripts/demo)
JUDGED_TASKS = ("calculator",)  # a judge needs a pretrained model's base weights; the tiny model's are no judge
PROMOTE_ALL = 10.0  # a promotion margin wider than the rewards' range: the held-out result gates no round

_UNLABELLED = """
SELECT episode_id, task_id, cwd FROM episodes
WHERE split = 'train' AND status = 'ok' AND labels->>'exact_right' IS NULL
  AND coalesce(labels->>'role', '') <> 'judge'
"""
_LABEL = """
UPDATE episodes SET labels = json_merge_patch(coalesce(labels, '{}'), json_object('exact_right', ?, 'exact_reward', ?))
WHERE episode_id = ?
"""
# per round: the training episodes the judge rewarded and the exact verifier labelled; agreement is the judge's
# score >= 0.5 where the exact verifier says right, below it where wrong
_AGREEMENT = """
SELECT s.round, count(*) AS episodes,
       avg(((s.reward >= 0.5) = (e.labels->>'exact_right')::BOOLEAN)::INTEGER) AS agreement,
       avg(s.reward) FILTER (WHERE (e.labels->>'exact_right')::BOOLEAN) AS judge_right,
       avg(s.reward) FILTER (WHERE NOT (e.labels->>'exact_right')::BOOLEAN) AS judge_wrong,
       avg((e.labels->>'exact_right')::BOOLEAN::INTEGER) AS exact_right
FROM episode_summary s JOIN episodes e USING (episode_id)
WHERE s.split = 'train' AND s.status = 'ok' AND s.reward IS NOT NULL AND e.labels->>'exact_right' IS NOT NULL
  AND coalesce(e.labels->>'role', '') <> 'judge'
GROUP BY s.round ORDER BY s.round
"""


def check_reward(reward: str, task: DemoTask, loop: LoopOptions | None) -> None:
    """A one-line error where `--reward judge` makes no sense, before anything runs."""
    if reward != "judge":
        return
    if task.name not in JUDGED_TASKS:
        raise LcapError(
            f"--reward judge: only --task {' or '.join(JUDGED_TASKS)} has a judge (SmolLM2's base weights with "
            f"scripts/demo/judge_rubric.md), not {task.name}"
        )
    if loop is not None and loop.overlap:
        raise LcapError("--reward judge judges each round's episodes once they are collected: not with --async")


def with_reference(tasks: list[dict]) -> list[dict]:
    """The training tasks with the `reference` the rubric gives the judge: the right answer's line."""
    return [{**task, "reference": f"Answer: {task['answer']}"} for task in tasks]


def judged_config(config: LoopConfig) -> LoopConfig:
    """The demo's loop with the judge rewarding its training episodes and the exact verifier its held-out ones."""
    exact = config.collect.verifier
    judge = replace(config.collect, verifier=f"judge:{demo_dir() / RUBRIC}", judge_mode="pointwise")
    return replace(
        config, collect=judge, eval_verifier=exact, options=replace(config.options, promote_margin=PROMOTE_ALL)
    )


def label_exact(store: Store, tasks: Path) -> int:
    """Label each training episode not labelled yet with the exact verifier's verdict on its stdout (what collect's
    verifier would have read); returns how many were labelled."""
    score = load_script(demo_dir() / "verify.py", "lcap_demo_verify").score
    answers = {t["id"]: str(t["answer"]) for t in map(json.loads, tasks.read_text().splitlines()) if t}
    labelled = 0
    with store.connect() as con:
        for episode_id, task_id, cwd in con.execute(_UNLABELLED).fetchall():
            stdout = Path(cwd).parent / "stdout.txt" if cwd else None
            if task_id not in answers or stdout is None or not stdout.is_file():
                continue
            verdict = score(answers[task_id], stdout.read_text(errors="replace"))
            con.execute(_LABEL, [str(bool(verdict["right"])).lower(), str(verdict["reward"]), episode_id])
            labelled += 1
    return labelled


def agreement_by_round(store: Store) -> list[dict]:
    """Per round, the judge's agreement with the exact verifier on the training episodes (`label_exact`)."""
    with store.connect(read_only=True) as con:
        cursor = con.execute(_AGREEMENT)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]


def reward_lines(reward: str, agreement: list[dict]) -> list[str]:
    """What trained the demo, for its summary: the exact verifier, or the judge with its agreement per round."""
    if reward != "judge":
        return ["rewards: the exact verifier (scripts/demo/verify.py) on every episode"]
    lines = [
        f"rewards: an LLM judge only on the training episodes (the policy server's base weights, pointwise, rubric "
        f"scripts/demo/{RUBRIC} with the right answer as its reference); held-out: the exact verifier"
    ]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines += [
        f"round {a['round']} judge vs the exact verifier: agreement {fmt(a['agreement'])} over {a['episodes']} "
        f"training episodes (exact right {fmt(a['exact_right'])}; mean judge score where right {fmt(a['judge_right'])}, "
        f"where wrong {fmt(a['judge_wrong'])})"
        for a in agreement
    ]
    return lines
