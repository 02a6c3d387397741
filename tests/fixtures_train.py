"""Fixtures of the train tests: a tiny real model and captured samples drawn from it.

The samples are real: prompts are tokenised with the model's chat template, completions are
sampled from the model itself in-process and carry the model's own logprobs, in exactly the
episode builder's `samples.parquet` schema. Multi-turn samples splice a tool result between two
sampled parts (env_mask 0, logprob 0.0 there), as the builder does when it merges turns.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lcap.dataset.build.samples_file import SAMPLE_SCHEMA  # the trainer reads what the builder writes


def make_tiny_model(out: Path, seed: int = 0) -> Path:
    """The serve stage's tiny Qwen2 (head_dim 64, byte-level BPE, ChatML template)."""
    from lcap.serve.options import TinyModelOptions
    from lcap.serve.tiny_model import init_model

    return init_model(out, TinyModelOptions(seed=seed))


def sample_from_model(
    model, tokenizer, prompt: str, *, max_new_tokens: int, seed: int
) -> tuple[list[int], list[int], list[float]]:
    """Sample one completion with the model itself; returns prompt ids, completion ids, their logprobs."""
    import torch

    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    torch.manual_seed(seed)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=2,
            return_dict_in_generate=True,
            output_scores=True,
            pad_token_id=tokenizer.pad_token_id,
        )
        scores = model.compute_transition_scores(gen.sequences, gen.scores, normalize_logits=True)[0]
    completion = gen.sequences[0, len(prompt_ids) :].tolist()
    return list(prompt_ids), completion, [float(x) for x in scores[: len(completion)]]


def write_samples(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), path)
    return path


def make_captured_samples(
    model_dir: Path,
    out: Path,
    *,
    n_groups: int = 2,
    group_size: int = 4,
    max_new_tokens: int = 8,
    multi_turn: bool = True,
    deployment: str = "base",
    round: int = 1,
    seed: int = 0,
) -> Path:
    """Write OUT/samples.parquet: real samples of the model; rewards 1,0,1,0... so each group has variance."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = []
    for g in range(n_groups):
        rewards = [float((k + g) % 2 == 0) for k in range(group_size)]
        mean = sum(rewards) / group_size
        std = (sum((r - mean) ** 2 for r in rewards) / (group_size - 1)) ** 0.5 or 1.0
        for k in range(group_size):
            prompt_ids, completion, logprobs = sample_from_model(
                model, tokenizer, f"question {g}: alpha beta", max_new_tokens=max_new_tokens, seed=seed + 100 * g + k
            )
            env_mask = [1] * len(completion)
            if multi_turn:
                tool = tokenizer.encode(
                    "<|im_start|>tool\ngamma delta<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
                )
                _, second, second_lp = sample_from_model(
                    model, tokenizer, "tool gamma", max_new_tokens=4, seed=seed + 7 * k + g
                )
                completion = completion + tool + second
                logprobs = logprobs + [0.0] * len(tool) + second_lp
                env_mask = env_mask + [0] * len(tool) + [1] * len(second)
            rows.append(
                dict(
                    sample_id=f"s{g}-{k}",
                    episode_id=f"e{g}-{k}",
                    task_id=f"t{g}",
                    round=round,
                    group_id=f"r{round}-t{g}",
                    prompt_ids=prompt_ids,
                    completion_ids=completion,
                    logprobs=logprobs,
                    env_mask=env_mask,
                    reward=rewards[k],
                    advantage=(rewards[k] - mean) / std,
                    deployment=deployment,
                    rebuilt=False,
                    truncated=False,
                    n_turns=2 if multi_turn else 1,
                    merged=multi_turn,
                )
            )
    return write_samples(out / "samples.parquet", rows)


@pytest.fixture(scope="session")
def tiny_train_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("train-model") / "tiny")


@pytest.fixture(scope="session")
def captured_samples(tiny_train_model, tmp_path_factory) -> Path:
    return make_captured_samples(tiny_train_model, tmp_path_factory.mktemp("train-samples"))
