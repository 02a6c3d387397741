"""The judge's planning (dataset/judge/plan.py, `plan_jobs` in dataset/judge/run.py): what fits the judge's context,
which fallback a group too long for one call gets (pairs, then pointwise), an episode too long even alone refused
with its reason, and the scores a Swiss tournament gives from a set of pairwise results."""

from __future__ import annotations

import itertools
import random

import pytest

from lcap.dataset.judge.plan import Budget, Swiss, pair_calls, pair_result, prompt_tokens, swiss_rounds
from lcap.dataset.judge.prompt import Rubric, Sample, group_order, group_prompt, pointwise_prompt
from lcap.dataset.judge.run import plan_jobs
from lcap.dataset.options import JudgeOptions


@pytest.fixture
def rubric(tmp_path):
    path = tmp_path / "rubric.md"
    path.write_text("Score 1 if the answer names the capital of France, else 0.")
    return Rubric.load(f"judge:{path}")


def sample(eid: str, answer: str, task: str = "t1") -> Sample:
    transcript = {
        "messages": [{"role": "user", "content": "The capital of France?"}, {"role": "assistant", "content": answer}]
    }
    return Sample(eid, {"id": task, "round": 1}, transcript)


GROUP = [sample("a", "Paris"), sample("b", "Lyon"), sample("c", "Lyon, I think")]
ANSWER = 50  # --judge-max-tokens of these tests


def need(messages, answers: int) -> int:
    return prompt_tokens(messages) + ANSWER * answers


def sizes(rubric, samples):
    """Tokens of the group's prompt, its largest pair's and its largest pointwise one's, answers included."""
    group = need(group_prompt(rubric, group_order(samples), 6000), len(samples))
    pair = max(need(group_prompt(rubric, [("1", s), ("2", s)], 6000), 2) for s in samples)
    alone = max(need(pointwise_prompt(rubric, s, 6000), 1) for s in samples)
    return group, pair, alone


def plan(samples, rubric, context, **options):
    return plan_jobs(samples, JudgeOptions(judge_max_tokens=ANSWER, **options), rubric, Budget(context, ANSWER))


def test_prompt_tokens_count_bytes_and_the_answer():
    messages = [{"role": "user", "content": "x" * 300}]
    assert prompt_tokens(messages) == 100 + 8
    assert prompt_tokens([{"role": "user", "content": "é" * 300}]) == 200 + 8  # UTF-8 bytes, not characters
    budget = Budget(context=108 + 2 * ANSWER, answer=ANSWER)
    assert budget.fits(messages, 2) and not budget.fits(messages, 3)
    assert "needs about 258 tokens" in budget.too_long(messages, 3, "it") and "reads 208" in budget.too_long(
        messages, 3, "it"
    )


def test_a_group_that_fits_is_one_call(rubric):
    group, _, _ = sizes(rubric, GROUP)
    jobs, refused = plan(GROUP, rubric, group)
    assert [job.mode for job in jobs] == ["group"] and not refused
    assert {s.episode_id for _, s in jobs[0].labelled} == {"a", "b", "c"}


def test_a_group_over_the_context_is_judged_in_pairs(rubric):
    group, pair, _ = sizes(rubric, GROUP)
    assert pair < group
    jobs, refused = plan(GROUP, rubric, group - 1)
    assert [job.mode for job in jobs] == ["pairs"] and not refused
    jobs, _ = plan(GROUP, rubric, pair)
    assert [job.mode for job in jobs] == ["pairs"]


def test_a_group_over_judge_max_chars_is_judged_in_pairs_whatever_the_context(rubric):
    big = [sample(f"big-{i}", "Paris " + "x" * 400) for i in range(3)]
    jobs, _ = plan(big, rubric, 100_000, judge_max_chars=1000)
    assert [job.mode for job in jobs] == ["pairs"]


def test_pairs_that_do_not_fit_fall_back_to_pointwise_and_too_long_alone_is_refused(rubric):
    _, pair, alone = sizes(rubric, GROUP)
    assert alone < pair
    jobs, refused = plan(GROUP, rubric, pair - 1)
    assert [job.mode for job in jobs] == ["pointwise"] * 3 and not refused
    jobs, refused = plan(GROUP, rubric, alone - 1)  # the longest one alone does not fit
    longest = max(GROUP, key=lambda s: need(pointwise_prompt(rubric, s, 6000), 1))
    assert longest.episode_id in refused and all(
        s.episode_id not in refused for _, s in itertools.chain(*(j.labelled for j in jobs))
    )
    assert "too long for the judge's context" in refused[longest.episode_id]
    assert f"reads {alone - 1}" in refused[longest.episode_id]
    jobs, refused = plan(GROUP, rubric, 300)
    assert jobs == [] and set(refused) == {"a", "b", "c"}  # nothing is sent, every one says why


def test_pointwise_mode_never_groups_and_still_refuses_what_does_not_fit(rubric):
    _, _, alone = sizes(rubric, GROUP)
    jobs, refused = plan(GROUP, rubric, 100_000, judge_mode="pointwise")
    assert [job.mode for job in jobs] == ["pointwise"] * 3 and not refused
    jobs, refused = plan(GROUP, rubric, alone - 1, judge_mode="pointwise")
    assert len(jobs) + len(refused) == 3 and refused


def test_groups_are_planned_apart_and_a_lone_sample_is_pointwise(rubric):
    samples = [*GROUP, sample("solo", "Paris", task="t2")]
    group, _, _ = sizes(rubric, GROUP)
    jobs, _ = plan(samples, rubric, group)
    assert sorted(job.mode for job in jobs) == ["group", "pointwise"]


def test_the_pair_hashes_differ_from_the_group_hashes(rubric):
    group, _, _ = sizes(rubric, GROUP)
    (as_group,), _ = plan(GROUP, rubric, group)
    (as_pairs,), _ = plan(GROUP, rubric, group - 1)
    assert set(as_group.hashes) == set(as_pairs.hashes) and not set(as_group.hashes.values()) & set(
        as_pairs.hashes.values()
    )


def test_rounds_and_calls_are_bounded():
    assert [swiss_rounds(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [0, 1, 2, 2, 3, 3, 4, 4]
    assert [pair_calls(n) for n in (2, 3, 4, 8, 16)] == [1, 2, 4, 12, 32]


def test_scores_from_a_given_set_of_results():
    swiss = Swiss(["a", "b", "c", "d"])
    assert swiss.pairs() == [("a", "b"), ("c", "d")]  # the first round in the group's order
    swiss.record("a", "b", 1.0)
    swiss.record("c", "d", 1.0)
    assert swiss.pairs() == [("a", "c"), ("b", "d")]  # winners meet winners
    swiss.record("a", "c", 1.0)
    swiss.record("b", "d", 1.0)
    assert swiss.pairs() == []
    # a 2/2; b and c 1/2, each having met a (1) and d (0): tied; d 0/2
    assert swiss.scores() == {"a": 1.0, "b": 0.5, "c": 0.5, "d": 0.0}


def test_ties_and_a_bye():
    swiss = Swiss(["x", "y", "z"])
    assert swiss.pairs() == [("x", "y")]  # z sits out
    swiss.record("x", "y", 0.5)
    assert swiss.pairs() == [("x", "z")]  # y, the lowest of the equals, sits out; z plays
    swiss.record("x", "z", 0.0)
    scores = swiss.scores()
    assert scores["z"] == 1.0 and scores["y"] > scores["x"]  # y tied once, x tied and lost
    assert pair_result(0.7, 0.2) == 1.0 and pair_result(0.2, 0.7) == 0.0 and pair_result(0.5, 0.5) == 0.5
    with pytest.raises(ValueError):
        swiss.record("x", "y", 0.3)
    with pytest.raises(ValueError):
        Swiss(["x"])


@pytest.mark.parametrize("n", range(2, 17))
def test_a_tournament_keeps_a_consistent_judges_order_within_its_bound(n):
    """A judge that always prefers the stronger sample: at most pair_calls(n) calls, no pair met twice, every sample
    compared, scores in [0, 1], the strongest alone at 1, the scores in the order of the standings."""
    rng = random.Random(n)
    labels = [str(i) for i in range(n)]
    strength = dict(zip(labels, rng.sample(range(n), n), strict=True))
    swiss = Swiss(labels)
    calls, seen = 0, set()
    while pairs := swiss.pairs():
        for first, second in pairs:
            assert frozenset((first, second)) not in seen
            seen.add(frozenset((first, second)))
            swiss.record(first, second, pair_result(strength[first], strength[second]))
            calls += 1
    assert calls <= pair_calls(n)
    assert all(swiss.met[label] for label in labels)
    scores = swiss.scores()
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    best = max(labels, key=strength.__getitem__)
    assert scores[best] == 1.0 and sorted(scores.values()).count(1.0) == 1
    for x, y in itertools.permutations(labels, 2):  # the scores follow the standings
        if swiss.rate(x) > swiss.rate(y):
            assert scores[x] > scores[y]
