"""build-dataset --advantage (group, batch, rloo) and --reward-source: the SQL macro `advantages_by` on a real DuckDB
store, against values computed here by hand, and the samples the builder writes from them."""

from __future__ import annotations

import math
import statistics

import pyarrow.parquet as pq
import pytest
from fixtures_dataset import chat_turns

from lcap.config import LcapError
from lcap.dataset.build.builder import build_dataset
from lcap.dataset.build.explain import explain
from lcap.dataset.options import BuildOptions
from lcap.train.samples import make_groups, read_samples

LIVE = "labels->>'attributed_by' IS NOT NULL"


@pytest.fixture
def mixed(builder, dstore):
    """Round 1: task t0 three times (1, 0, 0.5), task t1 once (1); live traffic: three sessions of the serving proxy
    (still running, no task, no round) rewarded 0.2, 0.8 and 0.6; a session without a reward. Later, a judge's
    re-score of t0-0 (0.25) and live-a (0.75) under the source `judge`, and a human's 0.9 for t0-1: the latest
    rewards of any source are t0 (0.25, 0.9, 0.5), t1 1, live (0.75, 0.8, 0.6)."""
    for sample, reward in enumerate((1.0, 0.0, 0.5)):
        builder.episode(f"t0-{sample}", sample=sample, reward=reward, turns=chat_turns([5, 6]))
    builder.episode("t1-0", task="t1", reward=1.0, turns=chat_turns([7]))
    for name, reward in (("live-a", 0.2), ("live-b", 0.8), ("live-c", 0.6)):
        builder.session(name, reward=reward, turns=chat_turns([8, 9], [10]))
    builder.session("live-unrewarded", turns=chat_turns([11]))
    builder.reward("t0-0", 0.25, source="judge")
    builder.reward("live-a", 0.75, source="judge")
    builder.reward("t0-1", 0.9, source="human")
    return dstore


def _advantages(store, method: str, source: str | None = None, ids: list[str] | None = None) -> dict[str, tuple]:
    rows = store.fetchall(
        "SELECT episode_id, reward, advantage, group_id, group_size, zero_variance FROM advantages_by(?, ?, ?)",
        [ids, method, source],
    )
    return {r[0]: r[1:] for r in rows}


def test_group_is_grpo_per_task_and_leaves_live_traffic_out(mixed):
    got = _advantages(mixed, "group")
    assert sorted(got) == ["t0-0", "t0-1", "t0-2", "t1-0"]  # a session has no task: no group to join
    std = statistics.stdev([0.25, 0.9, 0.5])
    mean = (0.25 + 0.9 + 0.5) / 3
    for episode, reward in (("t0-0", 0.25), ("t0-1", 0.9), ("t0-2", 0.5)):
        assert got[episode][:4] == pytest.approx((reward, (reward - mean) / (std + 1e-4), "1/train/t0", 3))
    assert got["t1-0"] == (1.0, 0.0, "1/train/t1", 1, True)  # a group of one: no signal
    old = {r[0]: r[1:] for r in mixed.fetchall("SELECT episode_id, reward, advantage FROM episode_advantages")}
    assert old == {e: v[:2] for e, v in got.items()}  # the default view is the group method


def test_batch_normalises_over_every_chosen_episode_live_ones_included(mixed):
    got = _advantages(mixed, "batch")
    rewards = {"t0-0": 0.25, "t0-1": 0.9, "t0-2": 0.5, "t1-0": 1.0, "live-a": 0.75, "live-b": 0.8, "live-c": 0.6}
    assert sorted(got) == sorted(rewards)  # the unrewarded session is out
    mean, std = 4.8 / 7, statistics.stdev(rewards.values())
    for episode, reward in rewards.items():
        assert got[episode][1] == pytest.approx((reward - mean) / (std + 1e-4))
        assert got[episode][3] == 7 and got[episode][4] is False
    assert {g[2] for g in got.values()} == {"train/batch/0"}  # seven episodes: one layout group (of about 8)

    live = _advantages(mixed, "batch", ids=["live-a", "live-b", "live-c"])  # a selection is its own batch
    mean, std = (0.75 + 0.8 + 0.6) / 3, statistics.stdev([0.75, 0.8, 0.6])
    assert live["live-a"][1] == pytest.approx((0.75 - mean) / (std + 1e-4))
    assert live["live-b"][1] == pytest.approx((0.8 - mean) / (std + 1e-4))


def test_rloo_subtracts_the_mean_of_the_others(mixed):
    live = _advantages(mixed, "rloo", ids=["live-a", "live-b", "live-c"])
    assert live["live-a"][1] == pytest.approx(0.75 - (0.8 + 0.6) / 2)
    assert live["live-b"][1] == pytest.approx(0.8 - (0.75 + 0.6) / 2)
    assert live["live-c"][1] == pytest.approx(0.6 - (0.75 + 0.8) / 2)
    assert _advantages(mixed, "rloo", ids=["live-a"])["live-a"][1] == 0.0  # a batch of one has no baseline


def test_a_reward_source_picks_that_sources_latest_reward(mixed):
    got = _advantages(mixed, "batch", source="judge")
    assert sorted(got) == ["live-a", "t0-0"]  # only the episodes the judge scored
    assert got["t0-0"][0] == 0.25 and got["live-a"][0] == 0.75
    assert got["t0-0"][1] == pytest.approx((0.25 - 0.5) / (statistics.stdev([0.25, 0.75]) + 1e-4))
    assert _advantages(mixed, "group", source="test")["t0-1"][0] == 0.0  # the older 'test' reward, not 0.9


def _build(store, tmp_path, name: str, **options) -> tuple:
    report = build_dataset(store, round=None, out=tmp_path / name, options=BuildOptions(**options))
    if not report.samples:  # nothing to train on writes no file (#51 row 5)
        assert not (tmp_path / name / "samples.parquet").exists()
        return report, []
    return report, pq.read_table(tmp_path / name / "samples.parquet").to_pylist()


def test_build_dataset_trains_live_traffic_with_a_batch_baseline(mixed, tmp_path):
    grouped, _ = _build(mixed, tmp_path, "group", where=LIVE)  # today's GRPO: nothing, and the report says why
    assert grouped.samples == 0 and grouped.episodes["rewarded"] == 0
    assert "no repeated prompt needed" in explain(grouped) or grouped.episodes["unfinished"] == 4

    report, samples = _build(mixed, tmp_path, "batch", where=LIVE, advantage="batch")
    assert report.episodes["rewarded"] == report.episodes["live_sessions"] == 3
    assert report.episodes["unfinished"] == 1  # the unrewarded session
    assert "REINFORCE++" in report.advantage
    by_episode = {s["episode_id"]: s for s in samples}
    assert sorted(by_episode) == ["live-a", "live-b", "live-c"]
    mean, std = (0.75 + 0.8 + 0.6) / 3, statistics.stdev([0.75, 0.8, 0.6])
    for episode, reward in (("live-a", 0.75), ("live-b", 0.8), ("live-c", 0.6)):
        assert by_episode[episode]["advantage"] == pytest.approx((reward - mean) / (std + 1e-4))
        assert by_episode[episode]["merged"] and by_episode[episode]["n_turns"] == 2
    groups = make_groups(read_samples(tmp_path / "batch"))  # the trainer keeps them: one layout group of three
    assert [len(m) for m in groups.groups.values()] == [3] and groups.dropped_alone == 0


def test_build_dataset_reward_source_without_where_uses_the_round(mixed, tmp_path):
    with pytest.raises(LcapError, match="needs --round, --where or both"):
        _build(mixed, tmp_path, "none", reward_source="judge")
    report = build_dataset(
        mixed, round=1, out=tmp_path / "r1", options=BuildOptions(reward_source="judge", keep_zero_variance=True)
    )
    assert report.episodes["rewarded"] == 1 and report.episodes["no_reward"] == 3
    assert "no reward from --reward-source judge" in explain(report)
    (sample,) = pq.read_table(tmp_path / "r1" / "samples.parquet").to_pylist()
    assert (sample["episode_id"], sample["reward"], sample["advantage"]) == ("t0-0", 0.25, 0.0)


def test_layout_groups_hold_at_least_the_layout_size(builder, dstore, tmp_path):
    for n in range(19):
        builder.session(f"s{n:02d}", reward=float(n % 3), turns=chat_turns([5]))
    _, samples = _build(dstore, tmp_path, "b", where=LIVE, advantage="rloo")
    sizes = sorted(sum(1 for s in samples if s["group_id"] == g) for g in {s["group_id"] for s in samples})
    assert sizes == [9, 10]  # 19 episodes over 19 // 8 = 2 layout groups, none short
    total = sum(s["reward"] for s in samples)
    for s in samples:
        assert s["advantage"] == pytest.approx(s["reward"] - (total - s["reward"]) / 18)
    assert math.isclose(sum(s["advantage"] for s in samples), 0.0, abs_tol=1e-9)


def test_bad_advantage_is_one_line():
    with pytest.raises(LcapError, match="--advantage must be group, batch or rloo, not 'ppo'"):
        BuildOptions(advantage="ppo")  # type: ignore[arg-type]
