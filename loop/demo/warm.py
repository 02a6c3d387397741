"""The demo's warm start: a short supervised pass that makes the tiny random-init model a base model that knows its
task in part, as a real base model would. One trainer for every demo task; a task brings its corpus (`Corpus`:
one example at a time, as token ids and a weight per token) and the trainer does the rest.

An example is what the policy would see and say: the prompt (weight 0: read, not learnt) and the answers (weight
1, and more for the word the answer copies from the context, the skill the tiny model is slowest to learn). A
multi-call episode is one example, its calls tokenised as the policy route stitches them. The examples of a task
open with the same tokens (a chat header, a system prompt and tool list): that shared prefix runs once a step at
batch size 1 and its keys and values serve the whole batch (the gradient flows back through them), and only the
positions that predict a weighted token go through the LM head.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lcap.progress import Reporter


@dataclass(frozen=True)
class Example:
    """One training example: token ids and, per token, the weight of predicting it (0: context only)."""

    ids: list[int]
    weights: list[float]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.weights):
            raise ValueError("an example needs one weight per token")


Corpus = Callable[[Any, random.Random], Example]
"""(tokenizer, rng) -> one example; called once per example, with the warm start's seeded generator."""


def answer_weights(completion: list[int], word: list[int], answer_weight: float, said: str) -> list[float]:
    """The weights of an answer's tokens: 1 each, `answer_weight` for the word it copies from the context. ValueError
    unless that word is one token and the answer holds it as read (`said`: the answer, for the message)."""
    if len(word) != 1 or word[0] not in completion:
        raise ValueError(f"the warm start needs single-token words copied as they are read: {said!r}")
    return [answer_weight if t == word[0] else 1.0 for t in completion]


def shared_prefix(examples: list[Example]) -> int:
    """How many leading tokens every example shares and none is trained on: they run once a step. The last shared
    token stays with the batch, since its logits predict the first token that differs."""
    first = examples[0].ids
    n = min(len(e.ids) for e in examples)
    for e in examples:
        n = next((i for i in range(n) if e.ids[i] != first[i]), n)
    trained = next((i for i in range(n) if any(e.weights[i] for e in examples)), n)
    return max(min(n, trained) - 1, 0)


def warm_start(
    model_dir: Path, corpus: Corpus, *, examples: int, steps: int, batch_size: int, lr: float, seed: int = 0
) -> dict:
    """Train the model in `model_dir` on `examples` examples drawn from `corpus` (no more than the steps read), with
    AdamW and a one-cycle schedule; saves in place. Returns the report `lcap demo` keeps as warm_start.json."""
    # the train extra
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(seed)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [corpus(tokenizer, rng) for _ in range(min(examples, steps * batch_size))]
    shared = shared_prefix(rows)
    prefix = torch.tensor([rows[0].ids[:shared]])
    length = max(len(r.ids) for r in rows) - shared
    inputs = torch.full((len(rows), length), tokenizer.pad_token_id)
    weights = torch.zeros(len(rows), length)
    for i, r in enumerate(rows):
        inputs[i, : len(r.ids) - shared] = torch.tensor(r.ids[shared:])
        weights[i, : len(r.ids) - shared] = torch.tensor(r.weights[shared:])
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    loss = None
    said = lambda: "" if loss is None else f"loss {loss:.3f}"  # noqa: E731
    with Reporter("warm start", max(steps, 0), said) as shown:
        for _ in range(max(steps, 0)):
            pick = torch.randint(0, len(rows), (batch_size,))
            cache = None
            if shared:
                cache = decoder(input_ids=prefix, use_cache=True).cache
                cache.batch_repeat_interleave(batch_size)
            hidden = decoder(input_ids=inputs[pick, :-1], cache=cache, use_cache=cache is not None).last_hidden_state
            w = weights[pick, 1:]
            where = w > 0  # only the positions that predict a trained token go through the LM head
            logits = head(hidden[where])
            per_token = torch.nn.functional.cross_entropy(logits, inputs[pick, 1:][where], reduction="none")
            step_loss = (per_token * w[where]).sum() / w[where].sum()
            step_loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            loss = step_loss.item()
            shown.advance()
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"steps": steps, "loss": loss, "examples": len(rows), "batch_size": batch_size, "lr": lr}
