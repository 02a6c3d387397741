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
from collections.abc import Callable
from pathlib import Path

from lcap.loop.demo.task import DemoSettings, DemoTask, demo_dir, script_command
from lcap.loop.demo.warm import Corpus, Example, answer_weights

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


def question(triple: list[str], answer: str) -> dict:
    """The number task: the words in the question."""
    a, b, c = triple
    return {"question": QUESTION.format(a=a, b=b, c=c), "answer": answer}


def make_tasks(
    words: list[str], *, n_train: int, n_eval: int, seed: int = 0, form: Callable[[list[str], str], dict] = question
) -> tuple[list[dict], list[dict]]:
    """Train and held-out tasks: distinct word triples, none in both, each made a task by `form` (triple, answer).
    The training tasks cycle through the number words, so each is the answer of about as many of them; held-out
    triples are drawn at random."""
    rng = random.Random(seed)
    numbers = sorted(w for w in words if w in NUMBERS)
    rng.shuffle(numbers)
    seen: set[tuple[str, ...]] = set()
    tasks: list[dict] = []
    while len(tasks) < n_train + n_eval:
        number = numbers[len(tasks) % len(numbers)] if len(tasks) < n_train else None
        triple, answer = make_triple(rng, words, number)
        if tuple(triple) in seen:
            continue
        seen.add(tuple(triple))
        tasks.append(form(triple, answer))
    train = [{"id": f"train-{i}", **t} for i, t in enumerate(tasks[:n_train])]
    held = [{"id": f"heldout-{i}", **t} for i, t in enumerate(tasks[n_train:])]
    return train, held


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


def corpus(words: list[str], *, p_correct: float, p_format: float, answer_weight: float) -> Corpus:
    """The warm start's examples: a question and an answer that is always one of its words, the number word
    `p_correct` of the time (else one of the other two), in the verifier's format `p_format` of the time."""

    def example(tokenizer, rng: random.Random) -> Example:
        (a, b, c), right = make_triple(rng, words)
        answer = right if rng.random() < p_correct else rng.choice([w for w in (a, b, c) if w != right])
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION.format(a=a, b=b, c=c)}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        form = FORMATS[0] if rng.random() < p_format else rng.choice(FORMATS[1:])
        c_ids = tokenizer(form.format(w=answer) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        word = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]  # the question's own token
        return Example(p_ids + c_ids, [0.0] * len(p_ids) + answer_weights(c_ids, word, answer_weight, answer))

    return example


def demo_corpus(words: list[str], settings: DemoSettings) -> Corpus:
    return corpus(
        words,
        p_correct=settings.warm_p_correct,
        p_format=settings.warm_p_format,
        answer_weight=settings.warm_answer_weight,
    )


def agent_command() -> list[str]:
    """scripts/demo/agent.py: one call, the question as the user message."""
    return script_command(demo_dir() / "agent.py", question="{question}")


TASK = DemoTask("number", agent_command, make_tasks, demo_corpus)
