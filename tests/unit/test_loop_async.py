"""`lcap loop --async`'s refusals before it starts (the loop on the vLLM CPU server: tests/e2e/test_loop_async.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lcap.config import LcapError
from lcap.loop.options import LoopOptions
from lcap.loop.steps import LoopConfig
from lcap.store import Store
from lcap.train.options import TrainOptions


def test_loop_options_refuse_negative_bounds():
    with pytest.raises(LcapError, match="--max-staleness"):
        LoopOptions(max_staleness=-1)
    sync = LoopConfig(run=Path("r"), rounds=1, tasks=Path("t.jsonl"), command=["a"])
    overlapped = LoopConfig(run=Path("r"), rounds=1, tasks=Path("t.jsonl"), command=["a"], options=LoopOptions(True))
    assert sync.key() != overlapped.key()  # a run folder is one kind of loop


def test_async_loop_refuses_ray_before_it_collects(tmp_path):
    from lcap.loop.overlap import run_async_loop
    from lcap.loop.steps import LoopState

    config = LoopConfig(
        run=tmp_path, rounds=1, tasks=tmp_path / "t.jsonl", command=["a"], train=TrainOptions(ray="local")
    )
    with pytest.raises(LcapError, match="--async runs its episodes on this machine"):
        run_async_loop(Store(tmp_path / "lcap.duckdb"), config, LoopState(tmp_path, config.key()), "base")
    assert not (tmp_path / "lcap.duckdb").exists()
