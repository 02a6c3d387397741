"""The files `lcap export` writes: their names and Arrow schemas (an OpenAI chat message as one struct, the Hugging
Face rows, verl's SFT and RL rows). build-dataset's `--format sft` samples carry the same messages."""

from __future__ import annotations

import pyarrow as pa

HF_DATA_FILE = "data/train-00000-of-00001.parquet"
HF_DISK_SPLIT = "train"  # load_from_disk's layout: dataset_dict.json naming this split, its folder of that name
HF_DISK_FILE = "data-00000-of-00001.arrow"
VERL_SFT_FILE = "sft.parquet"
VERL_RL_FILE = "rl.parquet"
VERL_DATA_SOURCE = "lcap"

TOOL_CALL = pa.struct(
    [
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)
MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL)),
        ("tool_call_id", pa.string()),
        ("name", pa.string()),
    ]
)
# Tools are JSON text in Parquet: their parameter schemas differ in shape, which one Arrow struct cannot hold.
HF_SCHEMA = pa.schema(
    [
        ("episode_id", pa.string()),
        ("task_id", pa.string()),
        ("round", pa.int32()),
        ("split", pa.string()),
        ("run", pa.string()),
        ("model", pa.string()),
        ("deployment", pa.string()),
        ("reward", pa.float64()),
        ("reward_source", pa.string()),
        ("labels", pa.string()),
        ("role", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("tools", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
    ]
)
VERL_SFT_SCHEMA = pa.schema(
    [
        ("messages", pa.list_(MESSAGE)),
        ("tools", pa.string()),
        ("episode_id", pa.string()),
        ("role", pa.string()),
        ("reward", pa.float64()),
    ]
)
VERL_RL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("task_id", pa.string()),
                    ("episodes", pa.int64()),
                    ("mean_reward", pa.float64()),
                    ("tools", pa.string()),
                ]
            ),
        ),
    ]
)
