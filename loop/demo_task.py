"""The demo's task and its warm start: "Which is a number: code seven tool" -> "Answer: seven".

The rule: of three words, answer the one that is a number word (13 of them, against 90 others). GRPO can
only sharpen what a policy already does sometimes, so a short supervised warm start makes the tiny
random-init model a base model that knows the rule only in part, as a real one would: in its corpus the
answer is always one of the question's words, the number word half the time (chance is one in three),
and written in the verifier's format half the time. The answer word weighs more than the format's words
in its loss (`answer_weight`): copying a word of the question is what the tiny model is slowest to learn,
and without it RL can only teach the format.

What RL must then learn is the rule itself: which of the three words to answer, on questions it never
saw. The training tasks are many distinct triples, each met once (the loop takes the next ones each
round), that cycle through the number words; the held-out triples are drawn apart from them.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from lcap.loop.demo import DemoSettings, DemoTask, demo_dir

QUESTION = "Which is a number: {a} {b} {c}"
# The verifier parses the first format; the warm start uses it `p_format` of the time, the others
# otherwise. In each, the word follows a space, so it is the same token as in the question: the
# answer is a copy. (A bare "{w}" is another token, and a tiny model then never learns to copy.)
FORMATS = ("Answer: {w}", "The answer is {w}.", "I think {w}")
NUMBERS = frozenset(
    ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "hundred", "thousand"]
)


def make_triple(rng: random.Random, words: list[str], number: str | None = None) -> tuple[list[str], str]:
    """Three words in random order, exactly one of them a number word (`number`, else a random one); returns
    (words, answer)."""
    numbers = sorted(w for w in words if w in NUMBERS)
    others = [w for w in words if w not in NUMBERS]
    answer = number or rng.choice(numbers)
    triple = [answer, *rng.sample(others, 2)]
    rng.shuffle(triple)
    return triple, answer


def read_words(path: Path) -> list[str]:
    return Path(path).read_text().split()


def make_tasks(words: list[str], *, n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train and held-out tasks: distinct word triples, none in both. The training tasks cycle through the
    number words, so each is the answer of about as many of them; held-out triples are drawn at random."""
    rng = random.Random(seed)
    numbers = sorted(w for w in words if w in NUMBERS)
    rng.shuffle(numbers)
    seen: set[tuple[str, ...]] = set()
    tasks: list[dict[str, str]] = []
    while len(tasks) < n_train + n_eval:
        number = numbers[len(tasks) % len(numbers)] if len(tasks) < n_train else None
        triple, answer = make_triple(rng, words, number)
        if tuple(triple) in seen:
            continue
        seen.add(tuple(triple))
        a, b, c = triple
        tasks.append({"question": QUESTION.format(a=a, b=b, c=c), "answer": answer})
    train = [{"id": f"train-{i}", **t} for i, t in enumerate(tasks[:n_train])]
    held = [{"id": f"heldout-{i}", **t} for i, t in enumerate(tasks[n_train:])]
    return train, held


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


def warm_start(
    model_dir: Path,
    words: list[str],
    *,
    p_correct: float = 1 / 3,
    p_format: float = 0.5,
    answer_weight: float = 5.0,
    examples: int = 4000,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict:
    """Supervised pass that teaches the answer format with a wrong-most-of-the-time answer; saves in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(seed)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = []
    for _ in range(examples):
        (a, b, c), right = make_triple(rng, words)
        answer = right if rng.random() < p_correct else rng.choice([w for w in (a, b, c) if w != right])
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION.format(a=a, b=b, c=c)}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        form = FORMATS[0] if rng.random() < p_format else rng.choice(FORMATS[1:])
        c_ids = tokenizer(form.format(w=answer) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        (word,) = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]  # the question's own token
        rows.append((p_ids, c_ids, c_ids.index(word)))
    # Every word is one token, so every prompt has the same length: answers are padded on the right
    # and only the answer positions go through the LM head.
    if len({len(p) for p, _, _ in rows}) != 1:
        raise ValueError("warm start needs single-token words (every prompt the same length)")
    n_answer = max(len(c) for _, c, _ in rows)
    ids = torch.full((len(rows), len(rows[0][0]) + n_answer), tokenizer.pad_token_id)
    labels = torch.full((len(rows), n_answer), -100)
    weights = torch.zeros(len(rows), n_answer)
    for i, (p, c, word) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, : len(c)] = torch.tensor(c)
        weights[i, : len(c)] = 1.0
        weights[i, word] = answer_weight
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    loss = None
    for _ in range(steps):
        pick = torch.randint(0, len(rows), (batch_size,))
        logits = model(input_ids=ids[pick, :-1], logits_to_keep=n_answer).logits
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels[pick].reshape(-1), ignore_index=-100, reduction="none"
        )
        out = (per_token * weights[pick].reshape(-1)).sum() / weights[pick].sum()
        out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        loss = out.item()
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return {
        "steps": steps,
        "loss": loss,
        "examples": examples,
        "p_correct": p_correct,
        "p_format": p_format,
        "answer_weight": answer_weight,
    }


def demo_tasks(settings: DemoSettings) -> tuple[list[dict], list[dict]]:
    words = read_words(demo_dir() / "words.txt")
    return make_tasks(words, n_train=settings.n_train, n_eval=settings.n_eval, seed=settings.seed)


def demo_warm_start(model_dir: Path, settings: DemoSettings) -> dict:
    return warm_start(
        model_dir,
        read_words(demo_dir() / "words.txt"),
        p_correct=settings.warm_p_correct,
        p_format=settings.warm_p_format,
        answer_weight=settings.warm_answer_weight,
        steps=settings.warm_steps,
        seed=settings.seed,
    )


def agent_command() -> list[str]:
    """scripts/demo/agent.py: one call, the question as the user message."""
    return [sys.executable, str(demo_dir() / "agent.py"), "--question", "{question}"]


TASK = DemoTask("number", agent_command, demo_tasks, demo_warm_start)
