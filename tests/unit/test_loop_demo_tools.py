"""`lcap demo --task tools`: its tasks, its warm start and its episodes, the store's views of its rounds (one round
on vLLM: tests/e2e/test_loop_demo_tools.py)."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

import pytest
from fixtures_dataset import chat_turns

from lcap.loop.demo.number import NUMBERS
from lcap.loop.demo.runner import calls_by_round, demo_task
from lcap.loop.demo.task import words
from lcap.loop.demo.tools import KEY, QUESTION, agent_module, lookups_by_round, warm_episode


def test_tasks_are_distinct_and_only_the_tool_knows_the_words():
    agent = agent_module()
    task = demo_task("tools")
    train, held = task.tasks(replace(task.settings(seed=1), n_train=65, n_eval=64))
    triples = [tuple(t["words"]) for t in train + held]
    assert len(set(triples)) == len(triples) == 129
    counts = Counter(t["answer"] for t in train)
    assert set(counts) == NUMBERS and max(counts.values()) - min(counts.values()) <= 1
    for t in train + held:
        assert t["question"] == QUESTION and not set(t["words"]) & set(QUESTION.lower().rstrip("?").split())
        assert [w for w in t["words"] if w in NUMBERS] == [t["answer"]]
        # the tool lists the words when asked for them, and has nothing for another word or the question
        assert agent.lookup(KEY, t["facts"]).startswith(f"the words: {' '.join(t['words'])} ")
        assert agent.lookup("answer", t["facts"]).startswith("no entry")
        assert agent.lookup(t["question"], t["facts"]).startswith("no entry")  # the harness's observation
    assert task.tasks(replace(task.settings(seed=1), n_train=65, n_eval=64)) == (train, held)


def test_warm_episodes_follow_the_agent():
    vocabulary = words()
    agent = agent_module()
    rng = random.Random(0)
    episodes = [warm_episode(rng, vocabulary, agent, p_lookup=0.5, p_correct=0.5, p_format=1.0) for _ in range(200)]
    looked_up = right = 0
    for calls in episodes:
        assert len(calls) == 3 and "tool_call" in calls[0][1] and all("text" in said for _, said in calls[1:])
        messages, said = calls[2]
        known = json.loads(calls[0][1]["tool_call"])["query"] == KEY
        looked_up += known
        tool = messages[3]["content"]
        assert messages[3]["role"] == "tool" and tool.startswith("no entry") != known
        assert messages[5]["content"].startswith("Observation 1: no entry")  # the harness's, after a plain answer
        assert calls[1][1] == said  # the answer, said again
        answer = said["text"].removeprefix("Answer: ")
        if known:
            listed = tool.removeprefix("the words: ").split(" (for")[0].split()
            assert answer in listed
            right += answer in NUMBERS
    assert 70 <= looked_up <= 130 and 0.3 * looked_up <= right <= 0.7 * looked_up


def test_the_warm_start_weighs_the_whole_lookup_call_and_the_copied_word(tiny_model_dir):
    """Trained tokens: every token of the lookup call weighs `warm_answer_weight` (its syntax is what a base model
    that can use its tool knows); in a text answer only the copied word does, the others 1; prompts 0."""
    from transformers import AutoTokenizer

    from lcap.loop.demo.tools import demo_corpus, lookup_call

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    settings = demo_task("tools").settings()
    example = demo_corpus(words(), settings)(tokenizer, random.Random(0))
    heavy = settings.warm_answer_weight
    call = tokenizer(lookup_call(KEY), add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(example.ids)) if example.ids[i : i + len(call)] == call)
    assert example.weights[start - 1] == 0.0 and set(example.weights[start : start + len(call) + 1]) == {heavy}
    trained = [w for w in example.weights[start + len(call) + 1 :] if w]
    assert trained.count(heavy) == 2 and set(trained) == {1.0, heavy}  # the word of each text answer


def test_calls_by_round_reads_stitching_and_merging_from_the_store(builder, dstore):
    """Round 1: two three-call episodes, the later calls of one stitched and extending (one sample), the other's
    third call starting afresh (two samples); round 2: single calls. Held-out episodes are left out."""
    builder.episode("a", task="t0", sample=0, reward=1.0, turns=chat_turns([5, 6], [7], [8]))
    split = chat_turns([5, 6], [7]) + [{"prompt_token_ids": [1, 2], "completion_token_ids": [9]}]
    builder.episode("b", task="t0", sample=1, reward=0.0, turns=split)
    builder.episode("c", task="t1", split="eval", reward=1.0, turns=chat_turns([5], [6], [7]))
    for i in range(2):
        builder.episode(f"d{i}", task="t2", sample=i, round=2, reward=float(i), turns=chat_turns([5]))
    with dstore.connect() as con:
        con.execute("UPDATE turns SET stitched = seq > 0 AND episode_id = 'a'")
    first, second = calls_by_round(dstore)
    assert first == dict(round=1, episodes=2, calls=3.0, stitched=0.5, samples=1.5, env_tokens=2.0)
    assert second == dict(round=2, episodes=2, calls=1.0, stitched=None, samples=1.0, env_tokens=0.0)


def test_lookups_by_round_reads_the_first_calls_query(builder, dstore):
    """Held-out episodes whose first call looked the words up, and the right answers among them: another query, a
    text answer first (a lookup only at a later call), a call the parser could not read and training episodes do
    not count as lookups. Of the other three, one looked the words up later; those that never did were wrong."""

    def lookup(query: str) -> dict:
        arguments = json.dumps({"query": query})
        return {"tool_calls": json.dumps([{"id": "c0", "name": "lookup", "arguments": arguments}])}

    text = {"completion_text": "Answer: seven"}
    episodes = {
        "a": ([lookup(KEY), text], True),
        "b": ([lookup(KEY), text], False),
        "c": ([lookup("number"), text], False),
        "d": ([text, lookup(KEY)], True),
        "f": ([{"completion_text": '<tool_call>\n{"name": "lookuu", "arguments": {"query": "words"}}'}, text], False),
    }
    for episode_id, (turns, right) in episodes.items():
        builder.episode(episode_id, split="eval", turns=turns)
        builder.reward(episode_id, 1.0 if right else 0.5, details={"right": right})
    builder.episode("e", turns=[lookup(KEY)], reward=1.0)
    expected = dict(looked_up=0.4, right_when_looked_up=0.5, later=1 / 3, right_when_never=0.0, broken=0.2)
    assert lookups_by_round(dstore) == {1: pytest.approx(expected)}


def test_an_unknown_task_or_another_tasks_folder_is_a_one_line_error(tmp_path):
    from typer.testing import CliRunner

    from lcap.cli import app

    result = CliRunner().invoke(app, ["demo", "--task", "nope", "--out", str(tmp_path / "demo")])
    assert result.exit_code == 2 and "--task 'nope': choose one of number, tools" in result.output
    assert not (tmp_path / "demo").exists()
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "demo.json").write_text(json.dumps({"task": "number"}))
    result = CliRunner().invoke(app, ["demo", "--task", "tools", "--out", str(tmp_path / "demo")])
    assert result.exit_code == 2 and "holds a demo of another task" in result.output
