"""Log-probabilities of the train tests' tiny model, and captured samples whose logprobs are shifted from them by
known amounts (kept out of the fixture plugins: importing the trainer costs seconds that every run would pay)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import torch
from fixtures_train import write_samples

from lcap.train.grpo import TrainOptions
from lcap.train.samples import Sample, read_samples


def token_logps(model, sample: Sample) -> torch.Tensor:
    """Log-probability of each completion token under `model`, one forward pass, no padding."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.completion_ids)[:, None])[:, 0]


def train_options(model_dir: Path, **kw) -> TrainOptions:
    """Training options on MODEL_DIR that report nowhere, with KW on top."""
    return TrainOptions(base_model=str(model_dir), report_to="none", **kw)


def perturbed_samples(tiny_train_model, captured_samples, out: Path) -> tuple[Path, dict, list[Sample]]:
    """Captured samples whose behaviour logprobs differ from the model's by known amounts per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_train_model).eval()
    rows = pq.read_table(captured_samples).to_pylist()
    shifts = (0.3, -1.0, 0.0, -0.2)  # captured = true + shift: ratio exp(-shift); exp(1.0) > the 2.0 cap
    for row, sample in zip(rows, read_samples(captured_samples)):
        true = token_logps(model, sample).tolist()
        row["logprobs"] = [t + shifts[i % 4] if m else 0.0 for i, (t, m) in enumerate(zip(true, sample.env_mask))]
    path = write_samples(out / "samples.parquet", rows)
    samples = read_samples(path)
    train_logps = {s.sample_id: token_logps(model, s) for s in samples}
    return path, train_logps, samples
