"""Training throughput: a GRPO step on captured samples (lcap's TRL trainer) vs bare PyTorch.

    .venv/bin/python benchmarks/bench_train.py [--groups 8] [--group-size 8] [--steps 6] [--hidden 256] [--repeats 3]

Both sides train the same LoRA-wrapped model on the same captured samples (real completions of
the model, multi-turn with env tokens) for the same number of optimiser steps with the same
batch; the bare side is one forward + backward + AdamW step of a policy-gradient loss over the
padded batch. Prints tokens/s of each and the ratio (target: GRPO <= 1.3x the bare time).

What is timed is the step, the two sides interleaved so that a busy machine slows both alike:
after each GRPO optimiser step, a callback runs one bare step. The GRPO time is TRL's training
loop (`on_train_begin` to `on_train_end`) less the bare steps run inside it. Each repeat is a
fresh `prepare_round`, as `lcap train` does; one warm-up round and one warm-up bare step come
first. The set-up that `Trainer.train()` pays once per round before its loop (a full
`gc.collect`, the optimiser, the dataloader) is printed apart.

Before a round's first step, `lcap train` runs the mismatch guard (lcap.train.mismatch): one no-grad
forward over up to `--mismatch-samples` samples per deployment. It is timed apart, on the same round, and
printed as a share of the round's GRPO time.

The GRPO step does work the bare one does not: per step, the IS ratio against the captured
behaviour logprobs, gradient clipping, the entropy and clip metrics; and when the steps make more
than one pass over the samples (epochs > 1), once per round a no-grad forward over the round's
samples for the old-policy log-probs (PPO's clip anchor). With one pass (--steps x 2 groups <=
--groups) there is no such forward: the IS ratio comes from the loss forward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from fixtures_train import make_captured_samples
    from transformers import PrinterCallback, TrainerCallback

    from lcap.serve.options import TinyModelOptions
    from lcap.serve.tiny_model import init_model
    from lcap.train.grpo import TrainOptions, prepare_round
    from lcap.train.mismatch import measure_mismatch

    tmp = Path(tempfile.mkdtemp(prefix="lcap-bench-train-"))
    model_dir = init_model(
        tmp / "model", TinyModelOptions(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64)
    )
    data = make_captured_samples(
        model_dir, tmp / "data", n_groups=args.groups, group_size=args.group_size, max_new_tokens=args.max_new_tokens
    )
    batch = 2 * args.group_size
    # epochs = steps: one TRL generation (one old/IS forward) per pass over the groups, as in `lcap train`.
    options = TrainOptions(
        base_model=str(model_dir),
        learning_rate=1e-4,
        batch_size=batch,
        epochs=max(1, args.steps * batch // (args.groups * args.group_size)),
        max_steps=args.steps,
        report_to="none",
        logging_steps=10**6,
    )  # no per-step log formatting in the timed loop

    samples = prepare_round(tmp / "run", 1, options, data=data).groups.samples
    tokens_per_step = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples) / len(samples) * batch

    # Bare PyTorch: the same model object class (fresh LoRA), the same batches, padded like TRL does.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    bare = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"),
    )
    opt = torch.optim.AdamW([p for p in bare.parameters() if p.requires_grad], lr=1e-4)
    batches = [samples[(i * batch) % len(samples) :][:batch] or samples[:batch] for i in range(args.steps)]

    def bare_step(chunk) -> None:
        p_len = max(len(s.prompt_ids) for s in chunk)
        c_len = max(len(s.completion_ids) for s in chunk)
        ids = torch.zeros(len(chunk), p_len + c_len, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros(len(chunk), c_len)
        adv = torch.tensor([s.advantage for s in chunk])
        for i, s in enumerate(chunk):
            ids[i, p_len - len(s.prompt_ids) : p_len] = torch.tensor(s.prompt_ids)
            ids[i, p_len : p_len + len(s.completion_ids)] = torch.tensor(s.completion_ids)
            attn[i, p_len - len(s.prompt_ids) : p_len + len(s.completion_ids)] = 1
            mask[i, : len(s.completion_ids)] = torch.tensor(s.env_mask, dtype=torch.float)
        logits = bare(input_ids=ids, attention_mask=attn, logits_to_keep=c_len + 1).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, p_len:, None])[..., 0]
        loss = -((logp * adv[:, None]) * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    def clocks() -> np.ndarray:
        """Wall and CPU (this process, all threads) seconds: CPU time is what a busy machine distorts least."""
        return np.array([time.perf_counter(), time.process_time()])

    class Interleave(TrainerCallback):
        """One bare step after each GRPO step; times TRL's loop and the bare steps inside it."""

        def __init__(self) -> None:
            self.bare = np.zeros(2)
            self.bare_steps = 0

        def on_train_begin(self, *_, **__) -> None:
            self.begin = clocks()

        def on_step_end(self, *_, **__) -> None:
            t0 = clocks()
            bare_step(batches[self.bare_steps % len(batches)])
            self.bare += clocks() - t0
            self.bare_steps += 1

        def on_train_end(self, *_, **__) -> None:
            self.loop = clocks() - self.begin

    def repeat(n: int) -> tuple[np.ndarray, np.ndarray, float, int, float]:
        """A fresh round interleaved with bare steps: bare and GRPO seconds (wall, CPU), set-up seconds, steps,
        and the seconds of the mismatch guard's forward, which `lcap train` runs before the round's first step."""
        prepared = prepare_round(tmp / f"run-{n}", 1, options, data)
        guard = measure_mismatch(
            prepared.trainer, prepared.groups.real_samples, per_deployment=options.mismatch_samples
        ).seconds
        clock = Interleave()
        prepared.trainer.add_callback(clock)
        prepared.trainer.remove_callback(PrinterCallback)  # its end-of-train metrics dump
        t0 = time.perf_counter()
        prepared.trainer.train()
        train_s = time.perf_counter() - t0
        steps = prepared.trainer.state.global_step
        assert clock.bare_steps == steps
        return clock.bare, clock.loop - clock.bare, train_s - clock.loop[0], steps, guard

    bare_step(batches[0])  # warm-up
    repeat(0)  # warm-up
    bare_s, grpo_s, setup_s, steps, guard_s = zip(*(repeat(n) for n in range(1, args.repeats + 1)))
    ratios = np.array(grpo_s) / np.array(bare_s)  # [repeat, (wall, CPU)]

    tokens = tokens_per_step * np.array(steps)
    bare_tps = np.median(tokens / np.array(bare_s)[:, 0])
    grpo_tps = np.median(tokens / np.array(grpo_s)[:, 0])
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, LoRA r16; batch {batch} samples "
        f"({tokens_per_step:.0f} tokens/step), {steps[0]} steps x {args.repeats} repeats, torch threads {torch.get_num_threads()}"
    )
    print(
        f"bare PyTorch fwd+bwd+AdamW : {bare_tps:8.0f} tokens/s  ({tokens_per_step / bare_tps * 1000:.0f} ms/step, median)"
    )
    print(
        f"lcap GRPO (TRL) step       : {grpo_tps:8.0f} tokens/s  ({tokens_per_step / grpo_tps * 1000:.0f} ms/step, median)"
    )
    print(f"Trainer.train() set-up, once per round: {statistics.median(setup_s):.2f} s")
    guard_share = np.array(guard_s) / np.array(grpo_s)[:, 0]
    print(
        f"mismatch guard, once per round before its first step (a no-grad forward over up to "
        f"{options.mismatch_samples} samples per deployment): {statistics.median(guard_s):.2f} s, "
        f"{np.median(guard_share):.0%} of the round's GRPO steps (median)"
    )
    best = np.array(grpo_s).min(axis=0) / np.array(bare_s).min(axis=0)  # noise only adds time: best of each side
    for name, column in (("wall", 0), ("CPU ", 1)):
        print(
            f"overhead ({name} time): {np.median(ratios[:, column]):.2f}x the bare time per token, median "
            f"(best of each side: {best[column]:.2f}x; target <= 1.3x); "
            f"repeats: {', '.join(f'{r:.2f}x' for r in ratios[:, column])}"
        )


if __name__ == "__main__":
    main()
