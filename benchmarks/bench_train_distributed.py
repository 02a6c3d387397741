"""One training round on one process and on two, side by side: plain, Ray Train, accelerate.

    .venv/bin/python benchmarks/bench_train_distributed.py [--groups 8] [--group-size 4] [--hidden 256] [--repeats 3]

The same round (the same captured samples of a tiny model, the same global batch) is trained by
`lcap train` four ways, the ways interleaved in each repeat so that a busy machine slows all alike:

    one process         lcap train
    ray, 1 worker       lcap train --ray ADDRESS --num-workers 1 --cpus-per-worker 2
    ray, 2 workers      lcap train --ray ADDRESS --num-workers 2 --cpus-per-worker 1
    accelerate, 2 proc  lcap train --accelerate-config scripts/accelerate/ddp.yaml --num-workers 2 (gloo)

The Ray cluster (one node, 2 CPUs, `ray start`) is started once, before the first repeat. Each
line prints the command's wall time (start-up, model load, workers, training, saving) and the
training loop's own time (train_runs.train_seconds), median and minimum over the repeats (the
minimum is the least disturbed by a busy machine), and the round's loss, which must agree across the
ways (tests/e2e/test_train_distributed.py holds them equal). On a machine with few cores two processes share them: the point of this benchmark here is the
overhead each launcher adds to a round, not a speed-up (that needs GPUs, one per worker).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from fixtures_ray import ray_head
    from fixtures_train import make_captured_samples

    from lcap.serve.options import TinyModelOptions
    from lcap.serve.tiny_model import init_model
    from lcap.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="lcap-bench-train-distributed-"))
    model = init_model(
        tmp / "model", TinyModelOptions(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64)
    )
    data = make_captured_samples(
        model, tmp / "data", n_groups=args.groups, group_size=args.group_size, max_new_tokens=args.max_new_tokens
    )
    common = ["--data", str(data), "--model", str(model), "--lr", "1e-4", "--report-to", "none"]
    common += ["--batch-size", str(2 * args.group_size)]
    with ray_head(tmp / "ray-head.log", num_cpus=2) as address:
        ways = {
            "one process": [],
            "ray, 1 worker x 2 CPUs": ["--ray", address, "--num-workers", "1", "--cpus-per-worker", "2"],
            "ray, 2 workers x 1 CPU": ["--ray", address, "--num-workers", "2", "--cpus-per-worker", "1"],
            "accelerate, 2 processes": [
                "--accelerate-config",
                str(REPO / "scripts" / "accelerate" / "ddp.yaml"),
                "--num-workers",
                "2",
            ],
        }
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
        for repeat in range(args.repeats):
            for i, (name, extra) in enumerate(ways.items()):
                out = tmp / f"r{repeat}-{i}"
                command = [sys.executable, "-m", "lcap", "train", "--round", "1", "--run", str(out / "run")]
                command += ["--db", str(out / "lcap.duckdb"), *common, *extra]
                t0 = time.perf_counter()
                result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
                wall = time.perf_counter() - t0
                if result.returncode != 0:
                    sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
                ((train_s, loss, steps),) = Store(out / "lcap.duckdb").fetchall(
                    "SELECT train_seconds, loss, steps FROM train_runs"
                )
                runs[name].append((wall, train_s, loss))
                print(f"  repeat {repeat + 1} {name}: {wall:.1f} s, training {train_s:.1f} s", file=sys.stderr)

    samples = args.groups * args.group_size
    print(
        f"round: {samples} samples ({args.groups} groups of {args.group_size}), batch {2 * args.group_size}, "
        f"{steps} steps; model hidden {args.hidden}, {args.layers} layers, LoRA r16; {os.cpu_count()} CPUs; "
        f"medians of {args.repeats} repeats"
    )
    print(f"{'':26} {'command s':>18} {'training s':>18} {'loss':>10}")
    print(f"{'':26} {'median':>9}{'min':>9} {'median':>9}{'min':>9}")
    for name, values in runs.items():
        wall, train = [v[0] for v in values], [v[1] for v in values]
        print(
            f"{name:26} {statistics.median(wall):9.1f}{min(wall):9.1f} {statistics.median(train):9.2f}{min(train):9.2f}"
            f" {values[0][2]:10.6f}"
        )


if __name__ == "__main__":
    main()
