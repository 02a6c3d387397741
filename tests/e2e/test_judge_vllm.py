"""The judge with a real model: `lcap collect --verifier judge:RUBRIC.md` on the tiny model served by vLLM, the
judge being lcap's default (the policy server's base weights, asked through a capture proxy of the judge pass).
The tiny model's verdicts are noise: the assertions are lcap's guarantees (every episode rewarded with reasons or
flagged, one call per group, each call an episode of its own, the cache), never the model's wording."""

from __future__ import annotations

import json

import pytest
from fixtures_dataset import py_agent

from lcap.dataset.collect.episodes import collect_episodes
from lcap.dataset.collect.rescore import rescore
from lcap.dataset.judge.run import JudgeResult
from lcap.dataset.options import CollectOptions, RescoreOptions
from lcap.store import Store

pytestmark = pytest.mark.vllm


def test_a_judged_collect_on_the_tiny_model(vllm_policy, openai_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = Store(tmp_path / "lcap.duckdb")
    tasks = tmp_path / "tasks.jsonl"
    rows = [
        {"id": "capital", "question": "What is the capital of France?", "reference": "Paris"},
        {"id": "planet", "question": "Name the largest planet.", "reference": "Jupiter"},
    ]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rubric.md").write_text("Score 1 if the answer matches the reference, else 0.")
    command = [*py_agent("openai_single.py"), "--question", "{question}", "--max-tokens", "8"]
    options = CollectOptions(
        group_size=3,
        concurrency=3,
        round=1,
        upstream="policy",
        timeout=180,
        verifier="judge:rubric.md",
        judge_max_tokens=200,
        judge_timeout=300,
    )
    result = collect_episodes(store, tasks=tasks, command=command, options=options)
    judge = result.judge
    assert judge is not None and judge.chosen == 6
    assert judge.calls == 2  # one call per group
    said = store.fetchall(
        "SELECT t.finish_reason, t.completion_tokens, t.completion_text FROM episodes e JOIN turns t USING "
        "(episode_id) WHERE e.labels->>'role' = 'judge'"
    )
    assert judge.judged + judge.failed == 6 and judge.judged >= 3, (judge.errors, said)
    assert judge.prompt_tokens > 0 and judge.call_seconds > 0
    rewards = store.fetchall("SELECT episode_id, value, details FROM rewards WHERE source = 'judge:rubric.md'")
    flagged = store.fetchall("SELECT episode_id FROM episode_flags WHERE flag = 'judge_error'")
    assert len(rewards) == judge.judged and len(flagged) == judge.failed
    calls = store.fetchall(
        "SELECT e.episode_id, e.labels->>'judged', t.model_requested, t.deployment FROM episodes e JOIN turns t USING "
        "(episode_id) WHERE e.labels->>'role' = 'judge'"
    )
    assert len(calls) == 2
    for eid, value, details in rewards:
        details = json.loads(details)
        assert 0.0 <= value <= 1.0 and isinstance(details["reasons"], str) and details["judge_mode"] == "group"
        assert details["judge_model"] == vllm_policy.served_model  # the base weights, no adapter
        judged = next(j for e, j, _, _ in calls if e == details["judge_episode"])
        assert eid in judged.split(",")
    assert {model for _, _, model, _ in calls} == {vllm_policy.served_model}

    # the same judge again (another source): the cache answers, no call
    again = rescore(store, RescoreOptions(verifier="judge:rubric.md", where="round = 1", source="again", tasks=tasks))
    assert isinstance(again, JudgeResult)
    assert again.calls == 0 and again.cached == judge.judged
    assert len(store.fetchall("SELECT 1 FROM episodes WHERE labels->>'role' = 'judge'")) == 2
