"""A round whose groups differ in size: zero-weight pad copies of one token (lcap's) vs full-length copies.

    .venv/bin/python benchmarks/bench_pad_copies.py --data RUN/round-N/data/samples.parquet --model MODEL [--repeats 2]

A GRPO group shorter than the round's largest is filled with zero-weight copies (lcap.train.samples). They move
nothing (advantage 0, loss mask 0); lcap's copies keep one prompt and one completion token, and the other arm
gives each copy its sample's whole length, as lcap did before. Each repeat trains the round once per arm with
`lcap train --data` (the arms alternate, so a busy machine slows both alike) and prints the tokens through the
model, the training seconds and the loss, which must be equal. The harness matrix's round
(tests/e2e/test_harnesses.py, kept with `--basetemp`) is a round of this kind: multi-call episodes make groups of
up to eight samples beside groups of two.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import duckdb

# The full-length arm: `lcap train` with Sample.pad_copy as it was (a copy of the whole sample).
FULL = """
import sys
from dataclasses import replace

from lcap.train import samples


def pad_copy(self):
    return replace(self, sample_id=f"{self.sample_id}#pad", env_mask=[0] * len(self.env_mask), advantage=0.0,
                   padding=True)


samples.Sample.pad_copy = pad_copy
from lcap.cli import app

sys.argv = ["lcap", *sys.argv[1:]]
app()
"""


def train(arm: str, data: Path, model: str, out: Path) -> tuple[float, int, float, int]:
    """One `lcap train` of `data` in arm `arm`: (loss, tokens, train seconds, pad copies)."""
    db = out / f"{arm}.duckdb"
    args = ["train", "--round", "1", "--db", str(db), "--run", str(out / arm), "--data", str(data)]
    args += ["--model", model, "--report-to", "none"]
    lcap = [sys.executable, "-c", FULL] if arm == "full" else [str(Path(sys.executable).parent / "lcap")]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run([*lcap, *args], check=True, env=env, capture_output=True)
    with duckdb.connect(str(db), read_only=True) as con:
        row = con.execute("SELECT loss, tokens, train_seconds, padded FROM train_runs").fetchone()
    assert row is not None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a round's samples.parquet")
    parser.add_argument("--model", required=True, help="the base model the round trains")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"full": [], "short": []}
    for repeat in range(args.repeats):
        for arm in ("full", "short"):
            with tempfile.TemporaryDirectory(prefix="lcap-bench-pad-") as out:
                loss, tokens, took, padded = train(arm, args.data, args.model, Path(out))
            seconds[arm].append(took)
            print(f"repeat {repeat} {arm:5}: loss {loss!r} tokens {tokens} train {took:.1f} s ({padded} pad copies)")
    ratios = [f / s for f, s in zip(seconds["full"], seconds["short"])]
    print(f"full-length copies / one-token copies, train seconds: {', '.join(f'{r:.2f}x' for r in ratios)}")


if __name__ == "__main__":
    main()
