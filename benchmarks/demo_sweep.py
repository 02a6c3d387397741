"""The demo's learning, in one process and in about a minute: for choosing the demo's task and settings.

    .venv/bin/python benchmarks/demo_sweep.py [--seed 0] [--rounds 5] [--set NAME=VALUE ...] [--truncated keep]
                                              [--eval-samples 4] [--fixed-tasks]

`lcap demo` spends its time running agents (a process each) through the proxy. This script keeps
everything else and drops that: the same tiny model, warm start, tasks, verifier and GRPO round
(`train_round`) as `lcap demo` with `DemoSettings` (override any with `--set lr=2e-3`), but completions are
sampled in-process with transformers' `generate` (temperature 1, the agent's 8-token limit) instead of by
vLLM behind the proxy. A group's advantage and the dataset's cleaning follow build-dataset: equal-reward
groups are left out, completions cut by the token limit are kept or dropped (`--truncated`). Held-out
questions are sampled `--eval-samples` times each (the demo: once), so the curve is less noisy than the
demo's. `--fixed-tasks` trains on the same questions every round instead of new ones.

Prints, per round: held-out mean reward, well-formed, right and cut-off shares, and the round's training
figures. Not a check of `lcap demo` itself: `scripts/demo/check_learning.py` reads a real run's store.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="A DemoSettings field, NAME=VALUE.")
    parser.add_argument("--truncated", choices=("keep", "drop"), default="keep")
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--fixed-tasks", action="store_true")
    parser.add_argument("--centred", action="store_true", help="Advantage r - group mean (no division by the std).")
    parser.add_argument("--model", type=Path, help="Reuse this warm-started model (made and kept there if absent).")
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import disable_progress_bar

    from lcap.dataset.samples_file import SAMPLE_SCHEMA
    from lcap.loop.demo import MODEL, DemoSettings
    from lcap.loop.demo_task import make_tasks, read_words, warm_start
    from lcap.serve.tiny_model import init_model
    from lcap.store import Store
    from lcap.train.grpo import train_round
    from lcap.train.options import TrainOptions

    sys.path.insert(0, str(ROOT / "scripts" / "demo"))
    from verify import score

    disable_progress_bar()
    torch.set_num_threads(1)
    fields = {f.name: f.type for f in dataclasses.fields(DemoSettings)}
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        overrides[name] = (int if fields[name] in ("int", int) else float)(value)
    settings = dataclasses.replace(DemoSettings(seed=args.seed), **overrides)
    print(f"settings: {settings}; truncated {args.truncated}; fixed tasks {args.fixed_tasks}", flush=True)

    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="lcap-demo-sweep-"))
    words = read_words(ROOT / "scripts" / "demo" / "words.txt")
    model_dir = args.model or work / "model"
    if not (model_dir / "config.json").exists():
        init_model(model_dir, dataclasses.replace(MODEL, seed=settings.seed))
        warm_start(
            model_dir,
            words,
            p_correct=settings.warm_p_correct,
            p_format=settings.warm_p_format,
            answer_weight=settings.warm_answer_weight,
            steps=settings.warm_steps,
            seed=settings.seed,
        )
    print(f"warm start: {time.perf_counter() - t0:.0f} s", flush=True)
    train_tasks, held_out = make_tasks(words, n_train=settings.n_train, n_eval=settings.n_eval, seed=settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    options = TrainOptions(
        base_model=str(model_dir),
        learning_rate=settings.lr,
        epochs=settings.epochs,
        epsilon_high=settings.epsilon_high,
        batch_size=settings.batch_size,
        report_to="none",
        seed=settings.seed,
        current="sweep",
    )

    def policy(adapter: Path | None):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        return model.eval()

    def sample(model, tasks: list[dict], n: int, seed: int) -> list[dict]:
        """n completions per task, as the agent asks for them: temperature 1, at most 8 tokens."""
        torch.manual_seed(seed)
        out = []
        for task in tasks:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": task["question"]}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            batch = torch.tensor([ids] * n)
            with torch.no_grad():
                gen = model.generate(
                    batch,
                    attention_mask=torch.ones_like(batch),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=8,
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                    return_dict_in_generate=True,
                    output_scores=True,
                )
                logps = model.compute_transition_scores(gen.sequences, gen.scores, normalize_logits=True)
            for k in range(n):
                completion = gen.sequences[k, len(ids) :].tolist()
                cut = eos not in completion
                length = len(completion) if cut else completion.index(eos) + 1
                verdict = score(task["answer"], tokenizer.decode(completion[:length], skip_special_tokens=True))
                out.append(
                    dict(
                        task=task,
                        prompt_ids=ids,
                        completion_ids=completion[:length],
                        logprobs=logps[k, :length].tolist(),
                        cut=cut,
                        **verdict,
                    )
                )
        return out

    def shares(rows: list[dict]) -> str:
        n = len(rows)
        return (
            f"reward {sum(r['reward'] for r in rows) / n:.3f} (well-formed {sum(r['well_formed'] for r in rows) / n:.2f},"
            f" right {sum(r['right'] for r in rows) / n:.2f}, cut off {sum(r['cut'] for r in rows) / n:.2f})"
        )

    store = Store(work / "lcap.duckdb")
    adapter = None
    k, g = settings.tasks_per_round, settings.group_size
    for n in range(args.rounds + 1):
        model = policy(adapter)
        line = f"round {n}: held-out {shares(sample(model, held_out, args.eval_samples, seed=10_000 + n))}"
        if n == args.rounds:
            print(f"{line} | {time.perf_counter() - t0:.0f} s", flush=True)
            break
        tasks = (
            train_tasks[:k]
            if args.fixed_tasks
            else [train_tasks[i % len(train_tasks)] for i in range(n * k, n * k + k)]
        )
        rows = sample(model, tasks, g, seed=n)
        samples = []
        for t in range(len(tasks)):
            group = rows[t * g : (t + 1) * g]
            rewards = [r["reward"] for r in group]
            if max(rewards) == min(rewards):
                continue  # no GRPO signal: build-dataset leaves equal-reward groups out
            mean = sum(rewards) / g
            std = (sum((x - mean) ** 2 for x in rewards) / (g - 1)) ** 0.5
            for i, r in enumerate(group):
                if r["cut"] and args.truncated == "drop":
                    continue
                samples.append(
                    dict(
                        sample_id=f"{n}-{t}-{i}",
                        episode_id=f"{n}-{t}-{i}",
                        task_id=r["task"]["id"],
                        round=n + 1,
                        group_id=f"{n + 1}/train/{r['task']['id']}",
                        prompt_ids=r["prompt_ids"],
                        completion_ids=r["completion_ids"],
                        logprobs=r["logprobs"],
                        env_mask=[1] * len(r["completion_ids"]),
                        reward=r["reward"],
                        advantage=(r["reward"] - mean) / (1.0 if args.centred else std + 1e-4),
                        deployment="sweep",
                        rebuilt=False,
                        truncated=r["cut"],
                        n_turns=1,
                        merged=False,
                    )
                )
        data = work / "run" / f"round-{n + 1}" / "data"
        data.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(samples, schema=SAMPLE_SCHEMA), data / "samples.parquet")
        adapter = train_round(store, work / "run", n + 1, options, data=data).output
        print(f"{line} | training: {shares(rows)}, {len(samples)} samples trained", flush=True)


if __name__ == "__main__":
    main()
