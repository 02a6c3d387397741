"""The multi-turn merge vectorised with numpy (`merge_turns`) against a Python loop over the same rows, side by side.

    .venv/bin/python benchmarks/bench_merge.py [--turns 50000] [--rounds 3]

Generates a store with benchmarks/synthetic_store.py (4-call episodes, groups of 8, every 10th episode's history
rewritten so that it does not merge, about 1% truncated), reads its calls as one Arrow table in the shape
build-dataset gives `merge_turns`, then merges them both ways, in a new random order each round:
- numpy: `merge_turns` (dataset/build/merge.py);
- Python loop: the rule in plain Python: the calls sorted by (group, episode, thread, seq), each one compared
  with the one before it (same episode and deployment, the previous not truncated, its prompt starting with
  the previous prompt + completion) and appended to the open sample or starting a new one; the same sample
  columns built as Arrow arrays at the end.
Both outputs are checked equal (sample ids, tokens, log-probs, masks, calls per sample). Printed per round and
as medians: seconds and calls per second, and how many times as long the loop took.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).parent))

from synthetic_store import make_store

from lcap.dataset.build.merge import merge_turns

CALLS = """
SELECT t.episode_id, e.task_id AS group_id, t.seq, t.deployment, false AS rebuilt,
       t.finish_reason = 'length' AS truncated, t.prompt_token_ids::INTEGER[] AS prompt_ids,
       t.completion_token_ids::INTEGER[] AS completion_ids, t.completion_logprobs::FLOAT[] AS logprobs,
       e.round::INTEGER AS round
FROM turns t JOIN episodes e USING (episode_id)
"""

COMPARED = ("sample_id", "episode_id", "group_id", "prompt_ids", "completion_ids", "logprobs", "env_mask", "n_turns")


def merge_loop(turns: pa.Table) -> pa.Table:
    rows = turns.to_pylist()
    rows.sort(key=lambda r: (r["group_id"], r["episode_id"], r["seq"], r["seq"]))
    samples: list[dict] = []
    prev: dict | None = None
    for row in rows:
        prompt, completion = row["prompt_ids"], row["completion_ids"]
        if (
            prev is not None
            and row["episode_id"] == prev["episode_id"]
            and row["deployment"] == prev["deployment"]
            and not prev["truncated"]
            and len(prompt) >= len(prev["prompt_ids"]) + len(prev["completion_ids"])
            and prompt[: len(prev["prompt_ids"])] == prev["prompt_ids"]
            and prompt[len(prev["prompt_ids"]) : len(prev["prompt_ids"]) + len(prev["completion_ids"])]
            == prev["completion_ids"]
        ):
            sample = samples[-1]
            env = prompt[len(prev["prompt_ids"]) + len(prev["completion_ids"]) :]
            sample["completion_ids"] += env + completion
            sample["logprobs"] += [0.0] * len(env) + row["logprobs"]
            sample["env_mask"] += [0] * len(env) + [1] * len(completion)
            sample["n_turns"] += 1
        else:
            part = samples[-1]["part"] + 1 if samples and samples[-1]["episode_id"] == row["episode_id"] else 0
            samples.append(
                {
                    "sample_id": f"{row['episode_id']}#{part}",
                    "episode_id": row["episode_id"],
                    "group_id": row["group_id"],
                    "part": part,
                    "prompt_ids": prompt,
                    "completion_ids": list(completion),
                    "logprobs": list(row["logprobs"]),
                    "env_mask": [1] * len(completion),
                    "n_turns": 1,
                }
            )
        prev = row
    return pa.table(
        {
            "sample_id": pa.array([s["sample_id"] for s in samples]),
            "episode_id": pa.array([s["episode_id"] for s in samples]),
            "group_id": pa.array([s["group_id"] for s in samples]),
            "prompt_ids": pa.array([s["prompt_ids"] for s in samples], pa.list_(pa.int32())),
            "completion_ids": pa.array([s["completion_ids"] for s in samples], pa.list_(pa.int32())),
            "logprobs": pa.array([s["logprobs"] for s in samples], pa.list_(pa.float32())),
            "env_mask": pa.array([s["env_mask"] for s in samples], pa.list_(pa.int8())),
            "n_turns": pa.array([s["n_turns"] for s in samples], pa.int32()),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(Path(tmp) / "bench.duckdb", turns=args.turns)
        with store.connect() as con:
            turns = con.sql(CALLS).to_arrow_table()
    paths: dict[str, Callable[[pa.Table], pa.Table]] = {"numpy": merge_turns, "Python loop": merge_loop}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    print(f"{len(turns):,} calls")
    for number in range(args.rounds):
        order = list(paths)
        random.shuffle(order)
        out = {}
        for name in order:
            t0 = time.perf_counter()
            out[name] = paths[name](turns)
            seconds[name].append(time.perf_counter() - t0)
        assert out["numpy"].select(COMPARED).equals(out["Python loop"].select(COMPARED)), "the two merges differ"
        ratio = seconds["Python loop"][-1] / seconds["numpy"][-1]
        print(
            f"round {number}: " + ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in paths) + f" ({ratio:.1f}x)",
            flush=True,
        )
    m = {name: statistics.median(values) for name, values in seconds.items()}
    merged = int(pa.compute.sum(out["numpy"]["n_turns"]).as_py()) - len(out["numpy"])
    print(
        f"medians: numpy {m['numpy']:.2f} s ({len(turns) / m['numpy']:,.0f} calls/s), Python loop "
        f"{m['Python loop']:.2f} s ({len(turns) / m['Python loop']:,.0f} calls/s): numpy "
        f"{m['Python loop'] / m['numpy']:.1f}x faster (per round: median "
        f"{statistics.median(p / n for p, n in zip(seconds['Python loop'], seconds['numpy'], strict=True)):.1f}x); "
        f"{len(out['numpy']):,} samples, {merged:,} calls merged"
    )


if __name__ == "__main__":
    main()
