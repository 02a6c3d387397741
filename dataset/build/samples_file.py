"""`samples.parquet`, the file `lcap build-dataset` writes and `lcap train` reads: its one definition.

One row per training sample (a merged run of an episode's calls). The trainer imports `read_samples_table`
and so reads exactly the columns written here.

`weight` is the sample's share of its episode (`--sample-weight`): with `episode`, 1/k for each of the k samples an
episode split into (a sub-agent's thread, a compaction, a deployment change), so every episode weighs 1 in all;
with `sample`, 1. The trainer applies it where its loss needs it (lcap.train.samples).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lcap.config import LcapError
from lcap.files import replacing

SAMPLES_FILE = "samples.parquet"

SAMPLE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("episode_id", pa.string()),
        ("task_id", pa.string()),
        ("round", pa.int32()),
        ("group_id", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("env_mask", pa.list_(pa.int8())),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("deployment", pa.string()),
        ("rebuilt", pa.bool_()),
        ("truncated", pa.bool_()),
        ("n_turns", pa.int32()),
        ("merged", pa.bool_()),
        ("weight", pa.float64()),
    ]
)

# Dictionary pages and min/max statistics pay off for the scalar columns only; on token lists they cost
# write time and buy nothing.
_DICTIONARY = ["sample_id", "episode_id", "task_id", "group_id", "deployment"]
_STATISTICS = [f.name for f in SAMPLE_SCHEMA if not pa.types.is_list(f.type)]


SAMPLE_WEIGHTS = ("episode", "sample")


def sample_weights(episode_ids: pa.ChunkedArray | pa.Array, mode: str) -> pa.Array:
    """Each sample's `weight`: 1/k for a sample of an episode written as k samples (`episode`), or 1 (`sample`)."""
    if mode == "sample" or len(episode_ids) == 0:
        return pa.array(np.ones(len(episode_ids)))
    counts = pc.value_counts(episode_ids)
    index = pc.index_in(episode_ids, value_set=counts.field("values")).to_numpy(zero_copy_only=False)
    return pa.array(1.0 / counts.field("counts").to_numpy()[index])


def samples_path(path: str | Path) -> Path:
    """A samples file, or the folder holding one."""
    path = Path(path)
    return path if path.suffix == ".parquet" else path / SAMPLES_FILE


def write_samples(table: pa.Table, path: Path, extra: pa.Table | None = None) -> None:
    """Write `table`'s sample columns atomically (a reader never sees half a file), and `extra`'s columns beside
    them (one row per sample: an SFT dataset's conversations), which `read_samples_table` leaves out."""
    samples = table.select(SAMPLE_SCHEMA.names).cast(SAMPLE_SCHEMA)
    if extra is not None:
        for name in extra.column_names:
            samples = samples.append_column(extra.schema.field(name), extra[name])
    with replacing(path) as tmp:
        pq.write_table(samples, tmp, row_group_size=16384, use_dictionary=_DICTIONARY, write_statistics=_STATISTICS)


def read_samples_table(path: str | Path) -> pa.Table:
    """Read a samples file; anything that is not one is a one-line error naming the missing columns."""
    path = samples_path(path)
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise LcapError(f"cannot read samples {path}: {exc}") from None
    if "weight" not in table.column_names:  # built before --sample-weight: each sample weighed 1
        table = table.append_column("weight", pa.array(np.ones(len(table))))
    missing = set(SAMPLE_SCHEMA.names) - set(table.column_names)
    if missing:
        raise LcapError(f"{path} is not a samples file: missing columns {', '.join(sorted(missing))}")
    return table.select(SAMPLE_SCHEMA.names).cast(SAMPLE_SCHEMA)
