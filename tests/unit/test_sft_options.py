"""The SFT round's options: what is refused, and `--sft-data` in a loop's identity."""

from __future__ import annotations

from pathlib import Path

import pytest

from lcap.config import LcapError
from lcap.loop.options import LoopOptions
from lcap.loop.steps import LoopConfig, LoopState
from lcap.train.options import TrainOptions


def test_sft_refuses_ray_and_the_async_loop():
    with pytest.raises(LcapError, match="--sft with --ray"):
        TrainOptions(sft=True, ray="local")
    with pytest.raises(LcapError, match=r"--sft-data .* drop --async"):
        LoopOptions(overlap=True, sft_data="sft/")


def test_sft_data_is_part_of_a_loops_key(tmp_path):
    def config(sft_data: str | None) -> LoopConfig:
        options = LoopOptions(sft_data=sft_data)
        return LoopConfig(run=tmp_path, rounds=1, tasks=Path("t.jsonl"), command=["a"], options=options)

    keys = {config(None).key(), config("sft-a/").key(), config("sft-b/").key()}
    assert len(keys) == 3
    LoopState(tmp_path, config("sft-a/").key()).save()
    with pytest.raises(LcapError, match="--sft-data"):
        LoopState(tmp_path, config("sft-b/").key())
