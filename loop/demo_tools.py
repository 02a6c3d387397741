"""`lcap demo --task tools`: the multi-turn tool agent and its task, "Which is the number: one, two or nine?".

The agent is scripts/agents/openai_tools.py (the one benchmarks/bench_stitching.py measures): the model
gets a `lookup` tool over the task's own fact (`--facts`, e.g. {"number": "the number is two"}) and
three calls. The answer is only in the tool's result: each task draws which of its three number words is
the one, so a model that does not read the tool's result can only guess (one in three). An episode as
the warm start writes it, and as the agent runs it:

    call 1  <tool_call>{"name": "lookup", "arguments": {"query": "number"}}</tool_call>
            tool: "the number is two (for 'number')"
    call 2  Answer: two
            the harness, since that was no tool call: "Observation 1: the number is two (...)"
    call 3  Answer: two            <- printed; scripts/demo/verify.py scores it

The warm start knows the format and the task in part: it looks "number" up `warm_p_lookup` of the time
(else another word, and the tool has no entry), and answers the number the tool gave `warm_p_correct` of
the time (else one of the question's other two), in the verifier's format `warm_p_format` of the time.
Every number word is one token, the same one in the question, the tool's result and the answer, so the
answer is a copy. What RL must learn is to look the right thing up and to answer with what the tool
said rather than another of the question's numbers, on questions it never saw. Calls 2 and 3 reach the
policy as prompts stitched onto the previous call's exact ids; build-dataset merges an episode's calls
into one sample whose tool results and observations are environment tokens (env_mask 0).
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

from lcap.config import LcapError
from lcap.loop.demo import DemoSettings, DemoTask, demo_dir
from lcap.loop.demo_task import FORMATS, NUMBERS, read_words

QUESTION = "Which is the number: {a}, {b} or {c}?"
KEY = "number"  # what the tool knows: the query that finds the task's fact
FACT = "the number is {number}"
WRONG_QUERIES = ("answer", "code", "word")  # the warm start's other lookups: the tool has no entry for them
TURNS = 3  # the agent's calls per episode: look up, answer, answer again after the harness's observation
MAX_TOKENS = 28  # per call: a lookup call is 21 tokens with its stop token


def agent_path() -> Path:
    path = Path(__file__).resolve().parent.parent / "scripts" / "agents" / "openai_tools.py"
    if not path.exists():
        raise LcapError(f"bundled tool agent not found at {path}: run `lcap demo --task tools` from an lcap checkout")
    return path


def agent_module() -> ModuleType:
    """The agent script as a module: the warm start writes episodes with its own tools, prompt and tool results."""
    spec = importlib.util.spec_from_file_location("lcap_demo_tool_agent", agent_path())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def agent_command() -> list[str]:
    return [
        sys.executable,
        str(agent_path()),
        "--question",
        "{question}",
        "--facts",
        "{facts}",
        "--turns",
        str(TURNS),
        "--max-tokens",
        str(MAX_TOKENS),
    ]


def make_task(rng: random.Random, words: list[str], number: str | None = None) -> dict:
    """Three number words in random order and the one of them the tool names (`number`, else a random one)."""
    numbers = sorted(w for w in words if w in NUMBERS)
    answer = number or rng.choice(numbers)
    candidates = [answer, *rng.sample([n for n in numbers if n != answer], 2)]
    rng.shuffle(candidates)
    a, b, c = candidates
    return {
        "question": QUESTION.format(a=a, b=b, c=c),
        "facts": {KEY: FACT.format(number=answer)},
        "answer": answer,
        "candidates": candidates,
    }


def make_tasks(words: list[str], *, n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct questions (the same three words in another order is another question), none in both sets; the
    training ones cycle through the number words as answers."""
    rng = random.Random(seed)
    numbers = sorted(w for w in words if w in NUMBERS)
    rng.shuffle(numbers)
    seen: set[str] = set()
    tasks: list[dict] = []
    while len(tasks) < n_train + n_eval:
        number = numbers[len(tasks) % len(numbers)] if len(tasks) < n_train else None
        task = make_task(rng, words, number)
        if task["question"] in seen:
            continue
        seen.add(task["question"])
        tasks.append(task)
    train = [{"id": f"train-{i}", **t} for i, t in enumerate(tasks[:n_train])]
    held = [{"id": f"heldout-{i}", **t} for i, t in enumerate(tasks[n_train:])]
    return train, held


def warm_episode(rng: random.Random, words: list[str], agent, *, p_lookup: float, p_correct: float, p_format: float):
    """One episode as the agent runs it: its messages before each call and the model's answer to each call
    (a tool call as the arguments the agent passes back, or a text)."""
    task = make_task(rng, words)
    query = KEY if rng.random() < p_lookup else rng.choice(WRONG_QUERIES)
    known = query == KEY

    def answer() -> str:
        wrong = [c for c in task["candidates"] if c != task["answer"]]
        if known:
            word = task["answer"] if rng.random() < p_correct else rng.choice(wrong)
        else:
            word = rng.choice(task["candidates"])
        form = FORMATS[0] if rng.random() < p_format else rng.choice(FORMATS[1:])
        return form.format(w=word)

    messages = [{"role": "system", "content": agent.SYSTEM}, {"role": "user", "content": task["question"]}]
    arguments = json.dumps({"query": query})
    tool_call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    calls = [(list(messages), {"tool_call": arguments})]
    messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": agent.lookup(query, task["facts"])})
    said = answer()
    calls.append((list(messages), {"text": said}))
    messages.append({"role": "assistant", "content": said})
    messages.append({"role": "user", "content": f"Observation 1: {agent.lookup(task['question'], task['facts'])}"})
    calls.append((list(messages), {"text": answer()}))
    return calls


def warm_start(
    model_dir: Path,
    words: list[str],
    *,
    p_lookup: float = 0.8,
    p_correct: float = 0.5,
    p_format: float = 0.5,
    answer_weight: float = 5.0,
    examples: int = 2000,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict:
    """Supervised pass on whole episodes (every call's answer, stitched as the policy route stitches them: the
    previous prompt's ids + the answer's ids + the new messages rendered); saves in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(seed)
    torch.manual_seed(seed)
    agent = agent_module()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    end = "<|im_end|>"

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def render(messages: list[dict]) -> str:
        return str(
            tokenizer.apply_chat_template(messages, tools=agent.TOOLS, add_generation_prompt=True, tokenize=False)
        )

    rows = []
    for _ in range(min(examples, steps * batch_size)):  # no more episodes than the steps read
        ids: list[int] = []
        mask: list[float] = []
        text = ""
        for messages, said in warm_episode(
            rng, words, agent, p_lookup=p_lookup, p_correct=p_correct, p_format=p_format
        ):
            prompt = render(messages)
            if not prompt.startswith(text):
                raise ValueError("the chat template rewrites earlier calls: the warm start cannot stitch them")
            new = encode(prompt[len(text) :])
            if "tool_call" in said:
                name_and_args = json.dumps({"name": "lookup", "arguments": json.loads(said["tool_call"])})
                completion = f"<tool_call>\n{name_and_args}\n</tool_call>"
                weighted = encode(json.loads(said["tool_call"])["query"])
            else:
                completion = said["text"]
                weighted = encode(" " + completion.rstrip(".").split()[-1])
            out = encode(completion + end)
            if len(weighted) != 1 or weighted[0] not in out:
                raise ValueError(f"warm start needs single-token words copied as they are read: {completion!r}")
            ids += new + out
            mask += [0.0] * len(new) + [answer_weight if t == weighted[0] else 1.0 for t in out]
            text = prompt + completion + end
        rows.append((ids, mask))
    # Every episode opens with the same system prompt and tool list (most of its tokens): run it once a step, at
    # batch size 1, and give its keys and values to the whole batch (the gradient flows back through them).
    shared = min(len(ids) for ids, _ in rows)
    for ids, _ in rows:
        shared = next((i for i in range(shared) if ids[i] != rows[0][0][i]), shared)
    shared -= 1  # the last shared token's logits predict the first answer-bearing token: keep it in the batch part
    if any(any(mask[:shared]) for _, mask in rows):
        raise ValueError("the shared prompt of the warm start's episodes holds an answer token")
    prefix = torch.tensor([rows[0][0][:shared]])
    length = max(len(ids) for ids, _ in rows) - shared
    inputs = torch.full((len(rows), length), tokenizer.pad_token_id)
    weights = torch.zeros(len(rows), length)
    for i, (ids, mask) in enumerate(rows):
        inputs[i, : len(ids) - shared] = torch.tensor(ids[shared:])
        weights[i, : len(ids) - shared] = torch.tensor(mask[shared:])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    loss = None
    for _ in range(steps):
        pick = torch.randint(0, len(rows), (batch_size,))
        cache = model(input_ids=prefix, use_cache=True).cache
        cache.batch_repeat_interleave(batch_size)
        logits = model(input_ids=inputs[pick, :-1], cache=cache).logits
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), inputs[pick, 1:].reshape(-1), reduction="none"
        )
        w = weights[pick, 1:].reshape(-1)
        step_loss = (per_token * w).sum() / w.sum()
        step_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        loss = step_loss.item()
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return {
        "steps": steps,
        "loss": loss,
        "examples": examples,
        "p_lookup": p_lookup,
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
        p_lookup=settings.warm_p_lookup,
        p_correct=settings.warm_p_correct,
        p_format=settings.warm_p_format,
        answer_weight=settings.warm_answer_weight,
        steps=settings.warm_steps,
        seed=settings.seed,
    )


TASK = DemoTask("tools", agent_command, demo_tasks, demo_warm_start, defaults={"warm_steps": 600})
