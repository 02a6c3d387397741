"""`lcap demo --task tools`: its tasks, its warm start's episodes, and one short round end to end on vLLM (the whole
run is measured, not tested: docs/benchmarks.md#demo)."""

from __future__ import annotations

import io
import itertools
import shutil
import sys
import time
from dataclasses import replace

import pytest

from lcap.loop.demo.runner import calls_by_round, demo_task
from lcap.store import Store


def test_warm_start_runs_on_the_tiny_model(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)  # the warm start saves in place
    task = demo_task("tools")
    report = task.warm_start(model, replace(task.settings(), warm_up_steps=3, warm_steps=2, warm_examples=8))
    assert report["steps"] == 2 and report["loss"] > 0 and report["task"] == "tools"
    assert [phase["steps"] for phase in report["phases"]] == [3, 2]  # the number task's questions, then episodes


@pytest.mark.slow
@pytest.mark.vllm
def test_one_round_of_the_tools_demo_stitches_and_merges(tmp_path, monkeypatch):
    """One short round of `lcap demo --task tools` on its own vLLM server: the store shows calls stitched onto the
    call before and samples that merge an episode's three calls, tool results masked as environment tokens."""
    from lcap.loop.demo.runner import run_demo

    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))  # its own server, not the session's
    settings = replace(
        demo_task("tools").settings(),
        n_train=3,
        tasks_per_round=3,
        group_size=4,  # groups whose rewards differ: else the round has nothing to train on
        n_eval=2,
        eval_group_size=1,
        warm_up_steps=300,  # the format and the copy, on short questions (seconds)
        warm_steps=100,
        concurrency=2,
        batch_size=4,
        epochs=1,
    )
    lines: list[str] = []
    stamped = _Stamped()
    monkeypatch.setattr(sys, "stderr", stamped)  # progress lines (not a terminal), each stamped as it comes
    monkeypatch.setenv("LCAP_PROGRESS_S", str(BEAT))
    results = run_demo(
        tmp_path / "demo", rounds=1, task="tools", settings=settings, echo=lambda line: stamped.said(lines, line)
    )
    assert [r["round"] for r in results["rounds"]] == [0, 1]
    (trained,) = calls_by_round(Store(tmp_path / "demo" / "lcap.duckdb"))
    assert trained["episodes"] == 12 and trained["calls"] == 3
    assert trained["stitched"] > 0, lines
    assert trained["samples"] < 2 and trained["env_tokens"] > 10
    with Store(tmp_path / "demo" / "lcap.duckdb").connect(read_only=True) as con:
        ((merged, masked),) = con.execute(
            "SELECT count(*) FILTER (WHERE n_turns = 3), count(*) FILTER (WHERE list_min(env_mask) = 0)"
            " FROM samples WHERE split = 'train'"
        ).fetchall()
    assert merged > 0 and masked > 0
    assert any("stitched" in line for line in lines)
    _the_greedy_control_is_lcap_evals(tmp_path / "demo", results, lines)
    gap, before, after = stamped.longest_gap()
    assert gap < GAP_MAX, f"{gap:.1f} s with nothing said between {before!r} and {after!r}"


BEAT = 1.0  # LCAP_PROGRESS_S in the demo's run: 30 s in use
GAP_MAX = 30.0  # the longest silence allowed at that beat: the piped bound in use, generous at a 1 s beat


class _Stamped(io.StringIO):
    """stderr (no terminal) that stamps each line it is given, and the demo's echo lines beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.stamps += [(time.monotonic(), line) for line in text.splitlines() if line.strip()]
        return super().write(text)

    def said(self, lines: list[str], line: str) -> None:
        lines.append(line)
        self.stamps.append((time.monotonic(), line))

    def longest_gap(self) -> tuple[float, str, str]:
        pairs = list(itertools.pairwise(self.stamps))
        (t0, before), (t1, after) = max(pairs, key=lambda p: p[1][0] - p[0][0])
        return t1 - t0, before, after


GREEDY_SQL = """
SELECT count(*), count(DISTINCT e.task_id), avg(CASE WHEN reward >= 1 THEN 1 ELSE 0 END), avg(coalesce(reward, 0))
FROM episode_summary e JOIN episodes USING (episode_id)
WHERE e.split = 'compare' AND episodes.labels->>'eval' = 'demo-greedy' AND episodes.labels->>'deployment' = ?
"""


def _the_greedy_control_is_lcap_evals(out, results: dict, lines: list[str]) -> None:
    """The summary's greedy rows: the base model and the last round that served, each once per held-out task, with
    the figures of `lcap eval`'s episodes in the store; in summary.md and the demo's last lines too."""
    greedy = results["greedy"]["rows"]
    served = [r["round"] for r in results["rounds"] if r["round"] > 0 and r["deployed"] not in (None, "refused")]
    assert [r["of_round"] for r in greedy] == [0, *served[-1:]]
    store = Store(out / "lcap.duckdb")
    for row in greedy:
        episodes, tasks, right, mean = store.fetchall(GREEDY_SQL, [row["deployment"]])[0]
        assert (row["episodes"], row["tasks"], row["k"]) == (episodes, tasks, 1) == (2, 2, 1)  # n_eval tasks, once
        assert (row["right"], row["mean_reward"]) == pytest.approx((right, mean))
    assert "| greedy (temperature 0) |" in (out / "summary.md").read_text()
    assert any(line.startswith("[demo] greedy (temperature 0) right answers: base ") for line in lines)
