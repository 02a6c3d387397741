"""The mismatch guard's figures on real vLLM: the right deployment against the failures it must catch.

    .venv/bin/python benchmarks/bench_mismatch.py [--model DIR] [--scale 0.5] [--samples 8] [--max-tokens 16]

Starts vLLM (CPU here) on the tiny model (or --model, e.g. a demo's warm-started `lcap-demo/model`) with its
own policy record, makes two random LoRA adapters (tests/fixtures_vllm.make_lora, B ~ N(0, scale)) and
samples completions from the served base, adapter A and adapter B. The trainer then measures each set as
`lcap train` does before its first step (lcap.train.mismatch), in the cases a round can meet:

    round 1, served by the base                          the right deployment (trainer: the base)
    round 2, served by adapter A                         the right deployment (trainer: continues A)
    round 2, served by adapter B                         the wrong adapter
    round 2, served by the base                          a skipped deploy

and prints KL per token (k3), mean |delta logp|, tokens, and the guard's seconds, against the default
limit (--mismatch-max).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

QUESTIONS = [
    "Which is a number: code seven tool",
    "Which is a number: file list three",
    "What is 2 + 2?",
    "Name a file.",
    "Sort the list.",
    "Write one short word.",
    "What is the answer?",
    "Please solve the task.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--samples", type=int, default=8, help="Samples per question.")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    import torch
    from fixtures_vllm import make_lora, served_samples

    from lcap.serve.deploy import deploy_policy
    from lcap.serve.server import start_server, stop_server
    from lcap.serve.tiny_model import init_model
    from lcap.train.grpo import prepare_round
    from lcap.train.mismatch import measure_mismatch
    from lcap.train.options import MISMATCH_MAX, TrainOptions

    if (os.cpu_count() or 1) <= 2:
        torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="lcap-bench-mismatch-"))
    os.environ["LCAP_POLICY_RECORD"] = str(work / "policy.json")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = args.model.resolve() if args.model else init_model(work / "tiny")
    lora_a = make_lora(model, work / "run" / "round-1" / "adapter", seed=1, scale=args.scale)
    lora_b = make_lora(model, work / "other" / "adapter", seed=2, scale=args.scale)
    record = start_server(str(model), log_path=work / "vllm.log", timeout=900, progress=False)
    try:
        name_a = deploy_policy(lora_a, round=1)
        name_b = deploy_policy(lora_b, name="other")
        data = {
            name: served_samples(
                record.url,
                name,
                work / f"data-{name}",
                questions=QUESTIONS,
                group_size=args.samples,
                max_tokens=args.max_tokens,
            )
            for name in (record.served_model, name_a, name_b)
        }
    finally:
        stop_server()

    options = TrainOptions(base_model=str(model), report_to="none", mismatch_samples=0, current="-")
    cases = [
        ("round 1, served by the base (right)", 1, record.served_model),
        ("round 2, served by adapter A (right)", 2, name_a),
        ("round 2, served by adapter B (wrong adapter)", 2, name_b),
        ("round 2, served by the base (skipped deploy)", 2, record.served_model),
    ]
    print(f"model {model}; LoRA B ~ N(0, {args.scale}); default limit --mismatch-max {MISMATCH_MAX}")
    print(f"{'case':48s} {'KL/token':>10s} {'|dlogp|':>9s} {'tokens':>7s} {'guard s':>8s}")
    for label, round, name in cases:
        prepared = prepare_round(work / "run", round, options, data[name])
        measured = measure_mismatch(prepared.trainer, prepared.groups.real_samples, per_deployment=0)
        (d,) = measured.deployments
        print(f"{label:48s} {d.kl:10.2e} {d.logp_diff:9.2e} {d.tokens:7d} {measured.seconds:8.2f}")


if __name__ == "__main__":
    main()
