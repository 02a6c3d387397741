"""Errors that say what to do: every "nothing to train on" names the counts by cause (from build-dataset's report)
and the option that changes it (the CLI and collect's summary: tests/integration/test_explain.py)."""

from __future__ import annotations

import pytest
from fixtures_dataset import chat_turns, lost_samples_scenario

from lcap.config import LcapError
from lcap.dataset.build.builder import BuildOptions, build_dataset, last_report
from lcap.dataset.build.explain import NO_CALLS_FIX, explain


def test_loop_says_why_a_round_is_empty(builder, dstore, tmp_path):
    from lcap.loop.steps import train_step
    from lcap.train.options import TrainOptions

    for i in range(3):
        builder.episode(f"f{i}", sample=i, status="failed", turns=chat_turns([5, 2]))
    data = tmp_path / "run" / "round-1" / "data"
    build_dataset(dstore, round=1, out=data)
    with pytest.raises(LcapError) as caught:
        train_step(dstore, tmp_path / "run", 1, TrainOptions(), data)
    message = str(caught.value)
    assert message.startswith(f"round 1: nothing to train on in {data}: 3 of 3 episodes did not finish ok: 3 failed")
    assert "stderr.txt" in message


# scenario -> (the counts, the option or command that changes it)
EXPECTED = {
    "no_episodes": ("the store has no train episode of round 1", "lcap collect --round 1"),
    "not_finished": (
        "3 of 3 episodes did not finish ok: 1 failed (agent exit code not 0), 1 timed out, 1 unfinished",
        "raise --timeout; rerun the same `lcap collect`",
    ),
    "no_reward": (
        "2 of 2 finished episodes have no reward",
        "collect with --verifier, or reward them with `lcap reward",
    ),
    "no_calls": ("2 of 2 rewarded episodes have no usable LLM call (no LLM call of theirs was captured", NO_CALLS_FIX),
    "failed_calls": ("2 of 2 rewarded episodes have no usable LLM call (2 of 2 calls failed", "turns.error"),
    "equal_rewards": (
        "1 of 1 groups got the same reward for every sample and were dropped (2 samples",
        "a larger --group-size",
    ),
    "singleton": ("2 of 2 groups have a single rewarded episode", "collect with --group-size 2 or more"),
    "tampered": ("2 tampered samples dropped (--drop-tampered)", "build without --drop-tampered"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_nothing_to_train_names_counts_and_the_option(name, builder, dstore, tmp_path):
    options = lost_samples_scenario(builder, name)
    dstore.execute("SELECT 1")  # the schema exists even for a round without episodes
    report = build_dataset(dstore, round=1, out=tmp_path / "data", options=BuildOptions(**options))
    assert report.samples == 0
    what, fix = EXPECTED[name]
    line = explain(report)
    assert what in line, line
    assert fix in line, line
    # nothing to train on writes no file (#51 row 5); the store's report, as train and loop read it: the same words
    assert not (tmp_path / "data").exists()
    assert explain(last_report(dstore, tmp_path / "data")) == line


def test_an_empty_build_leaves_an_earlier_build_as_it_was(builder, dstore, tmp_path):
    """A build that finds nothing writes no 0-row samples.parquet nor report.json over an earlier build's (#51 row 5)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "samples.parquet").write_bytes(b"earlier")
    (data / "report.json").write_text("{}")
    report = build_dataset(dstore, round=7, out=data)
    assert report.samples == 0
    assert (data / "samples.parquet").read_bytes() == b"earlier" and (data / "report.json").read_text() == "{}"
    assert "the store has no train episode of round 7" in explain(last_report(dstore, data))


@pytest.mark.parametrize("name", ["singleton", "equal_rewards"])
def test_an_sft_build_keeps_what_grpo_loses_for_its_groups_and_says_nothing_of_them(name, builder, dstore, tmp_path):
    options = lost_samples_scenario(builder, name)
    report = build_dataset(dstore, round=1, out=tmp_path / "data", options=BuildOptions(**options, format="sft"))
    assert report.samples == report.sample_counts["built"] > 0
    assert explain(report) == "no loss counted in the report"


def test_train_names_stale_samples_dropped(tmp_path):
    from lcap.train.fit import nothing_to_train
    from lcap.train.samples import Sample, make_groups

    samples = [
        Sample(f"s{i}", "1/train/t0", [1], [2], [-0.1], [1], float(i), 0.0, deployment="policy-r1") for i in range(2)
    ]
    groups = make_groups(samples, stale="drop", current="policy-r2")
    assert not groups.groups
    line = nothing_to_train("round 1", tmp_path / "samples.parquet", samples, groups, "policy-r2")
    assert "2 of 2 samples were served by another deployment than policy-r2 and dropped (--stale drop)" in line
    assert "train with --stale correct" in line
    assert "no report.json" not in line
