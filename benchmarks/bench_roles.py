"""One adapter per role (issue 52), what it costs: decode throughput of the policy server with 1, 2 and 4 LoRA
adapters in use at once, and the training cost of a round with two roles against one.

    .venv/bin/python benchmarks/bench_roles.py [--model smollm2|tiny] [--max-tokens 32] [--repeats 3]

Decode: `lcap serve` on the model (SmolLM2-135M-Instruct by default, lcap's own copy; `lcap setup smollm2`), four
LoRA adapters of lcap's rank (16, all linear layers, non-zero weights) deployed as four roles (`deploy_roles`, as
`lcap deploy --role` does), then 16 completions at once that ignore the end token (each decodes MAX_TOKENS tokens),
spread round-robin over the first 1, 2 or 4 adapters; the same prompts in every arm, the arms interleaved in each
repeat so that a busy machine slows them alike, after a warm-up batch on each adapter. Once with lcap's LoRA slots
(`--max-loras 2`: two adapters per batch) and once with `--max-loras 4` (one slot per role). Prints tokens/s per arm
(median of the repeats) and each arm's ratio to one adapter.

Training: a round of 2 x N training samples (real completions of the tiny model, the shape bench_train.py uses),
each episode a planner call and a solver call: one adapter trained on all of them (`lcap train`), against two trained
on each role's N (`lcap train --role planner`, then `--role solver`), the same samples and batch size. Each arm is
`train_round` end to end (model load, trainer set-up, mismatch guard, steps, adapter save), fresh run folders, the
arms interleaved. Prints the seconds of each arm (median) and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CONCURRENCY = 16
ADAPTERS = (1, 2, 4)
ROLES = ("planner", "solver")


async def decode(url: str, models: list[str], max_tokens: int) -> float:
    """Tokens/s of CONCURRENCY completions at once, request i asking for models[i % len(models)]."""
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="bench") as client:
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*[_one(client, models, n, max_tokens) for n in range(CONCURRENCY)]))
        return tokens / (time.perf_counter() - started)


async def _one(client: AsyncOpenAI, models: list[str], n: int, max_tokens: int) -> int:
    reply = await client.completions.create(
        model=models[n % len(models)],
        prompt=f"Count on from {n}:",
        max_tokens=max_tokens,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None
    return reply.usage.completion_tokens


def decode_arms(model: Path, work: Path, max_tokens: int, repeats: int) -> None:
    from fixtures_vllm import make_lora

    from lcap.serve import deploy_roles, start_server, stop_server

    adapters = [make_lora(model, work / f"adapter-{i}", seed=i, rank=16) for i in range(max(ADAPTERS))]
    for n, (setting, args) in enumerate(SETTINGS.items()):
        record = start_server(str(model), log_path=work / f"vllm-{n}.log", timeout=900, extra_args=args)
        try:
            served = deploy_roles({f"role{i}": path for i, path in enumerate(adapters)})
            names = [served[f"role{i}"] for i in range(len(adapters))]
            for name in names:  # warm-up: each adapter once
                asyncio.run(decode(record.url, [name], 4))
            rates: dict[int, list[float]] = {k: [] for k in ADAPTERS}
            for r in range(repeats):
                for k in ADAPTERS[r % len(ADAPTERS) :] + ADAPTERS[: r % len(ADAPTERS)]:  # a rotated order each repeat
                    rates[k].append(asyncio.run(decode(record.url, names[:k], max_tokens)))
        finally:
            stop_server()
        median = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"decode, {setting}, concurrency {CONCURRENCY}, {max_tokens} tokens each: "
            + ", ".join(
                f"{k} adapter{'s' * (k > 1)} {median[k]:.1f} tokens/s ({median[k] / median[1]:.2f}x)" for k in ADAPTERS
            )
            + f"; repeats: {'; '.join(f'{k}: ' + ' '.join(f'{x:.1f}' for x in v) for k, v in rates.items())}",
            flush=True,
        )


SETTINGS = {"lcap's LoRA slots (--max-loras 2)": [], "--max-loras 4": ["--max-loras", "4"]}


def two_role_store(model: Path, db: Path, groups: int, group_size: int, max_new_tokens: int):
    """Round 1's training episodes: `groups` tasks x `group_size`, each a planner call and a solver call sampled from
    the model with its logprobs; rewards 1, 0, 1, 0... (shifted per task) so every group has something to learn."""
    from fixtures_dataset import StoreBuilder
    from fixtures_train import sample_from_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lcap.store import Store

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model).eval()
    store = Store(db)
    builder = StoreBuilder(store)
    for g in range(groups):
        for k in range(group_size):
            turns = []
            for r, role in enumerate(ROLES):
                prompt, completion, logprobs = sample_from_model(
                    policy,
                    tokenizer,
                    f"{role} {g}: alpha beta",
                    max_new_tokens=max_new_tokens,
                    seed=100 * g + 10 * k + r,
                )
                turns.append(
                    {
                        "prompt_token_ids": prompt,
                        "completion_token_ids": completion,
                        "completion_logprobs": logprobs,
                        "role": role,
                        "deployment": "base",
                    }
                )
            builder.episode(f"t{g}-{k}", task=f"t{g}", sample=k, reward=float((k + g) % 2 == 0), turns=turns)
    return store


def training_arms(work: Path, groups: int, group_size: int, repeats: int) -> None:
    from lcap.dataset import BuildOptions, build_dataset
    from lcap.serve import TinyModelOptions, init_model
    from lcap.train import TrainOptions, train_round

    model = init_model(work / "tiny", TinyModelOptions(hidden_size=256, num_layers=4, num_heads=4))
    store = two_role_store(model, work / "lcap.duckdb", groups, group_size, max_new_tokens=32)
    data = {None: work / "data-all", **{role: work / f"data-{role}" for role in ROLES}}
    built = {
        role: build_dataset(store, round=1, out=out, options=BuildOptions(), role=role).samples
        for role, out in data.items()
    }
    assert built[None] == sum(built[role] for role in ROLES), built  # the same samples in both arms
    options = TrainOptions(base_model=str(model), batch_size=16, epochs=1, report_to="none", logging_steps=10**6)
    arms = {
        "one adapter": lambda run: [train_round(store, run, 1, options, data=data[None])],
        "two roles": lambda run: [train_round(store, run, 1, options, data=data[r], role=r) for r in ROLES],
    }
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(repeats + 1):  # the first: warm-up
        for name in list(arms)[r % 2 :] + list(arms)[: r % 2]:
            t0 = time.perf_counter()
            arms[name](work / f"run-{name.replace(' ', '-')}-{r}")
            if r:
                seconds[name].append(time.perf_counter() - t0)
    one, two = (statistics.median(seconds[name]) for name in arms)
    print(
        f"training a round, tiny model (hidden 256, 4 layers, LoRA r16), {built[None]} samples ({groups} tasks x "
        f"{group_size} episodes x 2 calls), batch 16: one adapter {one:.1f} s, two roles ({built['planner']} + "
        f"{built['solver']} samples) {two:.1f} s ({two / one:.2f}x); repeats: "
        + "; ".join(f"{name}: " + " ".join(f"{x:.1f}" for x in v) for name, v in seconds.items()),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="the served model")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()

    from lcap.serve import TinyModelOptions, init_model, init_pretrained, pretrained_dir

    work = Path(tempfile.mkdtemp(prefix="lcap-bench-roles-"))
    os.environ["LCAP_POLICY_RECORD"] = str(work / "policy.json")  # a server of its own, beside any other
    training_arms(work / "train", args.groups, args.group_size, args.repeats)
    if args.model == "smollm2":
        model = init_pretrained(pretrained_dir("smollm2"), "smollm2")
    else:
        model = init_model(work / "served", TinyModelOptions(hidden_size=256, num_layers=4, num_heads=4))
    decode_arms(model, work, args.max_tokens, args.repeats)


if __name__ == "__main__":
    main()
