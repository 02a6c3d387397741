"""GRPO's groups: short groups padded, stale samples dropped or kept (training: tests/e2e/test_train_grpo.py)."""

from __future__ import annotations

import math

from lcap.train.samples import Sample, make_groups


def sample(gid: str, k: int, deployment: str = "r1", reward: float = 0.0) -> Sample:
    return Sample(
        sample_id=f"{gid}-{k}",
        group_id=gid,
        prompt_ids=[1, 2],
        completion_ids=[3, 4],
        logprobs=[-1.0, -1.0],
        env_mask=[1, 1],
        reward=reward,
        advantage=reward - 0.5,
        deployment=deployment,
    )


def test_groups_pad_short_groups_and_drop_or_keep_stale():
    samples = [sample("a", k, reward=k % 2) for k in range(4)] + [
        sample("b", 0, "r0"),
        sample("b", 1),
        sample("b", 2, "r0"),
        sample("c", 0),
    ]
    groups = make_groups(samples, stale="correct", current="r1")
    assert groups.size == 4 and set(groups.groups) == {"a", "b"} and groups.dropped_small == 1
    padded = [s for s in groups.groups["b"] if s.padding]
    assert len(padded) == 1 and padded[0].advantage == 0.0 and set(padded[0].env_mask) == {0}

    dropped = make_groups(samples, stale="drop", current="r1")
    assert dropped.dropped_stale == 2 and set(dropped.groups) == {"a"}  # b keeps one sample: no signal
    assert math.isclose(dropped.mean_reward(), 0.5)
