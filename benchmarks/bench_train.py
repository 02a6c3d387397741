"""Training throughput: a GRPO step on captured samples (lcap's TRL trainer) vs bare PyTorch.

    .venv/bin/python benchmarks/bench_train.py [--groups 8] [--group-size 8] [--steps 6] [--hidden 256]

Both sides train the same LoRA-wrapped model on the same captured samples (real completions of
the model, multi-turn with env tokens) for the same number of optimiser steps with the same
batch; the bare side is one forward + backward + AdamW step of a policy-gradient loss over the
padded batch. Prints tokens/s of each and the ratio (target: GRPO <= 1.3x the bare time).

The GRPO step does one more forward than the bare one: the no-grad pass that gives the
importance-sampling ratio against the captured behaviour logprobs (TRL's old_per_token_logps).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    import torch

    from fixtures_train import make_captured_samples
    from lcap.store import Store
    from lcap.train.grpo import TrainOptions, prepare_round
    from lcap.train.tiny_model import init_model

    tmp = Path(tempfile.mkdtemp(prefix="lcap-bench-train-"))
    model_dir = init_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64)
    data = make_captured_samples(model_dir, tmp / "data", n_groups=args.groups, group_size=args.group_size,
                                 max_new_tokens=args.max_new_tokens)
    batch = 2 * args.group_size
    # epochs = steps: one TRL generation (one old/IS forward) per pass over the groups, as in `lcap train`.
    options = TrainOptions(base_model=str(model_dir), learning_rate=1e-4, batch_size=batch,
                           epochs=max(1, args.steps * batch // (args.groups * args.group_size)), max_steps=args.steps,
                           report_to="none")
    prepared = prepare_round(Store(tmp / "lcap.duckdb"), tmp / "run", 1, options, data=data)
    samples = prepared.groups.samples
    tokens_per_step = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples) / len(samples) * batch

    # Bare PyTorch: the same model object class (fresh LoRA), the same batches, padded like TRL does.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    bare = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                          LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in bare.parameters() if p.requires_grad], lr=1e-4)
    batches = [samples[(i * batch) % len(samples):][:batch] or samples[:batch] for i in range(args.steps)]

    def bare_step(chunk) -> None:
        p_len = max(len(s.prompt_ids) for s in chunk)
        c_len = max(len(s.completion_ids) for s in chunk)
        ids = torch.zeros(len(chunk), p_len + c_len, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros(len(chunk), c_len)
        adv = torch.tensor([s.advantage for s in chunk])
        for i, s in enumerate(chunk):
            ids[i, p_len - len(s.prompt_ids):p_len] = torch.tensor(s.prompt_ids)
            ids[i, p_len:p_len + len(s.completion_ids)] = torch.tensor(s.completion_ids)
            attn[i, p_len - len(s.prompt_ids):p_len + len(s.completion_ids)] = 1
            mask[i, :len(s.completion_ids)] = torch.tensor(s.env_mask, dtype=torch.float)
        logits = bare(input_ids=ids, attention_mask=attn, logits_to_keep=c_len + 1).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, p_len:, None])[..., 0]
        loss = -((logp * adv[:, None]) * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    bare_step(batches[0])  # warm-up, as TRL's first step also pays one-off costs below
    t0 = time.perf_counter()
    for chunk in batches:
        bare_step(chunk)
    bare_s = time.perf_counter() - t0

    trainer = prepared.trainer
    trainer.args.logging_steps = 10**6  # no per-step log formatting in the timed loop
    t0 = time.perf_counter()
    trainer.train()
    grpo_s = time.perf_counter() - t0
    steps = trainer.state.global_step

    bare_tps = tokens_per_step * len(batches) / bare_s
    grpo_tps = tokens_per_step * steps / grpo_s
    print(f"model: hidden {args.hidden}, {args.layers} layers, LoRA r16; batch {batch} samples "
          f"({tokens_per_step:.0f} tokens/step), {steps} steps, torch threads {torch.get_num_threads()}")
    print(f"bare PyTorch fwd+bwd+AdamW : {bare_tps:8.0f} tokens/s  ({bare_s / len(batches) * 1000:.0f} ms/step)")
    print(f"lcap GRPO (TRL) step       : {grpo_tps:8.0f} tokens/s  ({grpo_s / steps * 1000:.0f} ms/step)")
    print(f"overhead: {bare_tps / grpo_tps:.2f}x the bare time per token (target <= 1.3x)")


if __name__ == "__main__":
    main()
