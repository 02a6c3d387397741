"""`lcap demo --model smollm2`: a real pretrained model (SmolLM2-135M-Instruct) learns to use a calculator.

The agent is scripts/agents/calculator.py, an OpenAI-SDK tool agent as its author would write it for a small
model: a `calculator` tool, two worked examples in the history, temperature 1. The question is a product of
two two-digit numbers, which the model cannot work out itself; an episode it gets right calls the tool with the
question's expression and copies the tool's result into `Answer: <number>`:

    call 1  <tool_call>{"name": "calculator", "arguments": {"expression": "61 * 65"}}</tool_call>
            tool: "3965"
    call 2  Answer: 3965            <- printed; scripts/demo/verify.py scores it

There is no warm start: the base model is the released checkpoint. With two worked examples it gets about a
fifth of the questions right (it often answers without calling, invents a tool result, or breaks the call's JSON);
with three, more than half, past the 0.1-0.5 a base model should start in for RL to show what it adds. What RL
must learn is to call the tool every time, well-formed, and to answer with what it returned. The training
questions are met once each; the held-out ones are other pairs.
"""

from __future__ import annotations

from pathlib import Path

from lcap.loop.demo.task import DemoTask, bundled_agent, load_script, pair_tasks, script_command

QUESTION = "What is {a} * {b}?"
LOW, HIGH = 12, 99  # the factors: two digits, past what the model multiplies by heart
TURNS = 3  # calls per episode at most: a tool call, the answer, one more if the model calls again
MAX_TOKENS = 40  # per call: a calculator call is about 30 tokens


def agent_path() -> Path:
    return bundled_agent("calculator.py")


def agent_command() -> list[str]:
    return script_command(agent_path(), question="{question}", turns=TURNS, max_tokens=MAX_TOKENS)


def make_tasks(words: list[str], *, n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct factor pairs, none of the agent's worked examples (`pair_tasks`). `words` is the tiny tasks' word
    list, unused here."""
    seen = {tuple(sorted(p)) for p in load_script(agent_path(), "lcap_demo_calculator_agent").EXAMPLES}
    return pair_tasks(
        seen,
        lambda rng, a, b: {"question": QUESTION.format(a=a, b=b), "answer": str(a * b)},
        n_train=n_train,
        n_eval=n_eval,
        seed=seed,
        low=LOW,
        high=HIGH,
    )


TASK = DemoTask(
    "calculator",
    agent_command,
    make_tasks,
    corpus=None,
    model="smollm2",
    defaults={
        "rounds": 3,  # with held-out evaluation before and after each, a run within half an hour on two cores
        "n_train": 64,
        "tasks_per_round": 8,
        "group_size": 8,
        "n_eval": 64,
        "eval_group_size": 1,  # once each: the held-out episodes are the largest part of a round's time
        "concurrency": 8,
        "lr": 1e-4,
        "epochs": 1,
        "epsilon_high": 0.28,
        "batch_size": 16,
        # a pretrained model's activations over a batch of 400-token prompts are most of the trainer's memory
        "activation_checkpointing": True,
    },
)
