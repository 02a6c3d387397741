"""GRPO step time on SmolLM2-135M-Instruct (issue #34's training budget): LoRA (r16, all linear layers) beside full
fine-tuning, seconds per 1k completion tokens and each trainer process's peak RSS, in one run.

    .venv/bin/python benchmarks/bench_smollm2_train.py [--groups 4] [--group-size 8] [--steps 4] [--repeats 2]
        [--modes lora,full] [--threads 2] [--activation-checkpointing]

The samples are shaped as the calculator demo's (`lcap demo --model smollm2`): its agent's own first request (the
system prompt, the `calculator` tool, two worked examples and a question) rendered by the model's template, and
completions the model samples at temperature 1 with their log-probs, so the IS ratio is the real one. Each mode
trains `--steps` optimiser steps of `lcap train`'s round (prepare_round + Trainer.train) in a child process of its
own, the modes alternated (LoRA, full, LoRA, full...) so that a busy machine slows both alike and each peak RSS is
that mode's. `--threads 1,2` runs each mode at each torch thread count (the demo's synchronous loop trains on every
core, its `--async` loop on one). Needs `lcap setup smollm2`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from lcap.dataset.build.samples_file import SAMPLE_SCHEMA, write_samples
from lcap.loop.demo.calculator import agent_path
from lcap.loop.demo.task import load_script
from lcap.serve.pretrained import init_pretrained, pretrained_dir
from lcap.train.grpo import TrainOptions, prepare_round

MODES = {"lora": False, "full": True}  # mode -> TrainOptions.full
LEARNING_RATE = {"lora": 1e-4, "full": 1e-5}  # the demo's LoRA rate; a full fine-tune's usual one


def make_samples(model_dir: Path, out: Path, groups: int, group_size: int, max_new_tokens: int) -> Path:
    """OUT: groups of the agent's first call to the model, sampled by the model; rewards 1, 0, 1... per group."""
    agent = load_script(agent_path(), "calculator_agent")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for g in range(groups):
        messages = [{"role": "system", "content": agent.SYSTEM}]
        for n, (a, b) in enumerate(agent.EXAMPLES):
            messages += agent.worked_example(a, b, n)
        messages.append({"role": "user", "content": f"What is {37 + g} * {58 + g}?"})
        text = tokenizer.apply_chat_template(messages, tools=agent.TOOLS, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        torch.manual_seed(g)
        with torch.no_grad():
            done = model.generate(
                torch.tensor([prompt_ids] * group_size),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=end,
            )
        new = done.sequences[:, len(prompt_ids) :]
        logprobs = torch.stack([torch.log_softmax(s.float(), -1) for s in done.scores], 1)
        token_logprobs = logprobs.gather(-1, new[..., None])[..., 0]
        rewards = [float((k + g) % 2 == 0) for k in range(group_size)]
        mean = sum(rewards) / group_size
        std = statistics.stdev(rewards) or 1.0
        for k in range(group_size):
            ids = new[k].tolist()
            length = ids.index(end) + 1 if end in ids else len(ids)
            rows.append(
                dict(
                    sample_id=f"s{g}-{k}",
                    episode_id=f"e{g}-{k}",
                    task_id=f"t{g}",
                    round=1,
                    group_id=f"r1-t{g}",
                    prompt_ids=prompt_ids,
                    completion_ids=ids[:length],
                    logprobs=token_logprobs[k, :length].tolist(),
                    env_mask=[1] * length,
                    reward=rewards[k],
                    advantage=(rewards[k] - mean) / std,
                    deployment="base",
                    rebuilt=False,
                    truncated=end not in ids,
                    n_turns=1,
                    merged=False,
                )
            )
    write_samples(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), out)
    return out


def child(mode: str, model_dir: str, data: str, steps: int, batch: int, threads: int, checkpointing: bool) -> None:
    """One mode's round: prints seconds per optimiser step, completion tokens per step and peak RSS as JSON."""
    torch.set_num_threads(threads)
    options = TrainOptions(
        base_model=model_dir,
        full=MODES[mode],
        learning_rate=LEARNING_RATE[mode],
        batch_size=batch,
        max_steps=steps + 1,  # the first step (allocations, warm-up) is left out of the time
        epochs=100,
        report_to="none",
        logging_steps=10**6,
        activation_checkpointing=checkpointing,
    )
    run = Path(tempfile.mkdtemp(prefix=f"lcap-bench-{mode}-"))
    prepared = prepare_round(run, 1, options, Path(data))
    samples = prepared.groups.samples
    completion_per_step = sum(len(s.completion_ids) for s in samples) / len(samples) * batch
    prompt_tokens = sum(len(s.prompt_ids) for s in samples) / len(samples)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__) -> None:
            times.append(time.perf_counter() - self.t0)

    prepared.trainer.add_callback(Clock())
    prepared.trainer.train()
    step_s = statistics.median(times[1:])
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {"step_s": step_s, "completion_tokens": completion_per_step, "prompt": prompt_tokens, "peak_mib": peak_mib}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="samples per optimiser step (the demo's)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="the agent's max_tokens per call")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--threads", default="2", help="comma-separated torch thread counts, each mode at each")
    parser.add_argument("--activation-checkpointing", action="store_true", help="as the calculator demo trains")
    parser.add_argument("--child-threads", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DATA"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(
            args.child[0],
            args.model,
            args.child[1],
            args.steps,
            args.batch,
            args.child_threads,
            args.activation_checkpointing,
        )
        return

    model_dir = init_pretrained(pretrained_dir("smollm2"), "smollm2")
    tmp = Path(tempfile.mkdtemp(prefix="lcap-bench-smollm2-train-"))
    t0 = time.perf_counter()
    data = make_samples(model_dir, tmp / "samples.parquet", args.groups, args.group_size, args.max_new_tokens)
    print(f"samples sampled from the model in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    configs = [(mode, int(n)) for mode in args.modes.split(",") for n in args.threads.split(",")]
    results: dict[tuple[str, int], list[dict]] = {config: [] for config in configs}
    for _ in range(args.repeats):
        for mode, threads in configs:
            command = [sys.executable, __file__, "--child", mode, str(data), "--model", str(model_dir)]
            command += ["--steps", str(args.steps), "--batch", str(args.batch), "--child-threads", str(threads)]
            command += ["--activation-checkpointing"] if args.activation_checkpointing else []
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results[mode, threads].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{mode} x{threads}: {results[mode, threads][-1]}", file=sys.stderr)
    print(
        f"SmolLM2-135M-Instruct, fp32 on CPU; batch {args.batch} samples, activation checkpointing "
        f"{'on' if args.activation_checkpointing else 'off'}, {args.steps} timed steps x {args.repeats} repeats per "
        f"configuration, alternated; load {open('/proc/loadavg').read().split()[0]}"
    )
    per_1k = {}
    for (mode, threads), runs in results.items():
        per_1k[mode, threads] = statistics.median(r["step_s"] / r["completion_tokens"] * 1000 for r in runs)
        tokens = statistics.median(r["completion_tokens"] for r in runs)
        step = statistics.median(r["step_s"] for r in runs)
        peak = max(r["peak_mib"] for r in runs)
        print(
            f"{mode:4} x{threads} threads: {step:6.2f} s/step ({tokens:.0f} completion tokens/step, prompts "
            f"{runs[0]['prompt']:.0f} tokens), {per_1k[mode, threads]:6.2f} s per 1k completion tokens, "
            f"peak RSS {peak:.0f} MiB"
        )
    first = configs[0]
    for config in configs[1:]:
        print(f"{config[0]} x{config[1]} / {first[0]} x{first[1]} step time: {per_1k[config] / per_1k[first]:.2f}x")


if __name__ == "__main__":
    main()
