"""`lcap loop --live`'s options and its rule for trainable groups, in process."""

from __future__ import annotations

from pathlib import Path

import pytest

from lcap.config import LcapError
from lcap.loop.live import ready_groups
from lcap.loop.options import LoopOptions
from lcap.loop.steps import LoopConfig


def test_live_options_refuse_what_does_not_go_with_them():
    with pytest.raises(LcapError, match="not with --async or --sft-data"):
        LoopOptions(live=True, overlap=True)
    with pytest.raises(LcapError, match="--min-samples must be at least 2"):
        LoopOptions(live=True, min_samples=1)
    with pytest.raises(LcapError, match="--live trains on live traffic, not on --tasks"):
        LoopConfig(run=Path("r"), rounds=1, tasks=Path("t.jsonl"), command=[], options=LoopOptions(live=True))
    with pytest.raises(LcapError, match="give the training tasks"):
        LoopConfig(run=Path("r"), rounds=1, tasks=None, command=[])
    live = LoopConfig(run=Path("r"), rounds=1, tasks=None, command=["a"], options=LoopOptions(live=True))
    assert live.key() != LoopConfig(run=Path("r"), rounds=1, tasks=Path("t"), command=["a"]).key()


def test_a_group_trains_with_two_rewards_that_differ_unless_zero_variance_is_kept():
    rows = [
        ("a1", 1.0, "p-a", "d", "3"),
        ("b1", 1.0, "p-b", "d", "1"),
        ("a2", 0.0, "p-a", "d", "2"),
        ("b2", 1.0, "p-b", "d", "4"),
        ("c1", 0.0, "p-c", "d", "0"),
    ]
    assert [r[0] for r in ready_groups(rows, keep_zero_variance=False)] == ["a2", "a1"]  # first finished first
    assert [r[0] for r in ready_groups(rows, keep_zero_variance=True)] == ["b1", "a2", "a1", "b2"]
