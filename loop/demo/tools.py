"""`lcap demo --task tools`: the multi-turn tool agent and its task, "Which word is a number?".

The agent is scripts/agents/openai_tools.py (the one benchmarks/bench_stitching.py measures): the model gets a
`lookup` tool over the task's own fact (`--facts`, e.g. {"words": "the words: code seven tool"}) and three calls.
The three words are only in the tool's result: the question names none of them, and the harness's own
observation (it looks the question itself up after an answer in plain text) finds no entry. So the answer is a
copy of a word of the tool's result, as the number task's is a copy of a word of its question, and the rule
to learn is the same: which of the three is the number word. An episode as the warm start writes it, and as the
agent runs it:

    call 1  <tool_call>{"name": "lookup", "arguments": {"query": "words"}}</tool_call>
            tool: "the words: code seven tool (for 'words')"
    call 2  Answer: seven
            the harness, since that was no tool call: "Observation 1: no entry (for 'which word is a number?')"
    call 3  Answer: seven            <- printed; scripts/demo/verify.py scores it

The warm start knows the task in part: it looks "words" up `warm_p_lookup` of the time (else another word, and
the tool has no entry: then it answers a word it never saw, rarely right), answers one of the tool's three
words, the number word `warm_p_correct` of the time, in the verifier's format `warm_p_format` of the time, and
says its answer again at call 3. Every word is one token after a space, the same in the tool's result and in
the answer. What RL must learn is the rule and the format (and may learn to look the words up more often), on
word triples it never saw. Calls 2 and 3 reach the policy as prompts stitched onto the previous call's exact
ids; build-dataset merges an episode's calls into one sample whose tool results and observations are environment
tokens (env_mask 0).

The task's defaults differ from the number task's, each for a reason docs/benchmarks.md ("`lcap demo --task
tools`") measures: the warm start answers the number word more often (`warm_p_correct` 0.8), since the tiny model
learns the rule more slowly from a tool's result than from a question; it weighs every token of the lookup call
as the copied word (`warm_answer_weight`), since a call vLLM's parser cannot read leaves the episode nearly
always wrong, and the call's syntax is not what RL is here to teach; each held-out question is asked twice a
round, since at once a round's share moves by chance about as much as the bar allows; and RL steps at a third
of the number task's learning rate, since a sample trains on three calls' tokens and a faster round overshoots.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from types import ModuleType

from lcap.loop.demo.number import FORMATS, make_tasks, make_triple
from lcap.loop.demo.number import demo_corpus as number_corpus
from lcap.loop.demo.task import DemoSettings, DemoTask, bundled_agent, load_script, script_command
from lcap.loop.demo.warm import Corpus, Example, answer_weights

QUESTION = "Which word is a number?"  # names none of the words, nor the key the tool knows
KEY = "words"  # what the tool knows: the query that finds the task's words (in no question, no word list)
FACT = "the words: {a} {b} {c}"
WRONG_QUERIES = ("answer", "number", "question")  # the warm start's other lookups: the tool has no entry for them
TURNS = 3  # the agent's calls per episode: look up, answer, answer again after the harness's observation
MAX_TOKENS = 28  # per call: a lookup call is under 20 tokens with its stop token


def lookup_call(query: str) -> str:
    """A lookup call as the model writes it (vLLM's hermes parser reads it back as a tool call): the warm start's
    text, and what benchmarks/demo_first_call.py scores."""
    return "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"query": query}}) + "\n</tool_call>"


def agent_path() -> Path:
    return bundled_agent("openai_tools.py")


def agent_module() -> ModuleType:
    """The agent script as a module: the warm start writes episodes with its own tools, prompt and tool results."""
    return load_script(agent_path(), "lcap_demo_tool_agent")


def agent_command() -> list[str]:
    return script_command(agent_path(), question="{question}", facts="{facts}", turns=TURNS, max_tokens=MAX_TOKENS)


def lookups_by_round(store) -> dict[int, dict]:
    """Per round, of the held-out episodes: the share whose first call looked the words up (the `lookup` of `KEY`)
    and the right answers among them; the share of the others that looked them up at a later call; the right
    answers of the episodes that never did; and the share whose first call was a tool call vLLM's parser could
    not read (`<tool_call>` in a plain answer). What RL must learn is the rule and the lookup; the share of first
    calls that look up is where a round falls back."""
    with store.connect(read_only=True) as con:
        rows = con.execute(
            """
            WITH calls AS (
                SELECT s.round, t.episode_id, t.seq, (s.reward_details->>'right')::BOOLEAN AS is_right,
                       coalesce(t.tool_calls::JSON->0->>'name' = 'lookup'
                                AND (t.tool_calls::JSON->0->>'arguments')::JSON->>'query' = ?, false) AS looks_up,
                       coalesce(json_array_length(t.tool_calls::JSON), 0) = 0
                           AND contains(coalesce(t.completion_text, ''), '<tool_call>') AS broken
                FROM episode_summary s JOIN turns t USING (episode_id)
                WHERE s.split = 'eval' AND s.reward IS NOT NULL),
            episodes AS (
                SELECT round, any_value(is_right) AS is_right, arg_min(looks_up, seq) AS first,
                       bool_or(looks_up) AS ever, arg_min(broken, seq) AS broken
                FROM calls GROUP BY round, episode_id)
            SELECT round, avg(first::INTEGER), avg(is_right::INTEGER) FILTER (WHERE first),
                   avg(ever::INTEGER) FILTER (WHERE NOT first), avg(is_right::INTEGER) FILTER (WHERE NOT ever),
                   avg(broken::INTEGER)
            FROM episodes GROUP BY round""",
            [KEY],
        ).fetchall()
    return {
        n: dict(looked_up=share, right_when_looked_up=right, later=later, right_when_never=never, broken=broken)
        for n, share, right, later, never, broken in rows
    }


def tool_task(triple: list[str], answer: str) -> dict:
    """The tools task: the words in the tool's fact, none in the question."""
    a, b, c = triple
    return {"question": QUESTION, "facts": {KEY: FACT.format(a=a, b=b, c=c)}, "answer": answer, "words": triple}


def warm_episode(rng: random.Random, words: list[str], agent, *, p_lookup: float, p_correct: float, p_format: float):
    """One episode as the agent runs it: its messages before each call and the model's answer to each call
    (a tool call as the arguments the agent passes back, or a text)."""
    triple, right = make_triple(rng, words)
    task = tool_task(triple, right)
    query = KEY if rng.random() < p_lookup else rng.choice(WRONG_QUERIES)
    if query == KEY:
        word = right if rng.random() < p_correct else rng.choice([w for w in triple if w != right])
    else:
        word = rng.choice(words)  # nothing to copy: a guess
    said = (FORMATS[0] if rng.random() < p_format else rng.choice(FORMATS[1:])).format(w=word)

    messages = [{"role": "system", "content": agent.SYSTEM}, {"role": "user", "content": task["question"]}]
    arguments = json.dumps({"query": query})
    tool_call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    calls = [(list(messages), {"tool_call": arguments})]
    messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": agent.lookup(query, task["facts"])})
    calls.append((list(messages), {"text": said}))
    messages.append({"role": "assistant", "content": said})
    messages.append({"role": "user", "content": f"Observation 1: {agent.lookup(task['question'], task['facts'])}"})
    calls.append((list(messages), {"text": said}))
    return calls


def corpus(words: list[str], *, p_lookup: float, p_correct: float, p_format: float, answer_weight: float) -> Corpus:
    """The warm start's examples: whole episodes (`warm_episode`), tokenised as the policy route stitches them (the
    previous prompt's ids + the answer's ids + the new messages rendered); the answers are trained on, the word
    each copies (the answer word) and every token of the lookup call weighing `answer_weight`."""
    agent = agent_module()
    end = "<|im_end|>"

    def example(tokenizer, rng: random.Random) -> Example:
        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        ids: list[int] = []
        weights: list[float] = []
        text = ""
        for messages, said in warm_episode(
            rng, words, agent, p_lookup=p_lookup, p_correct=p_correct, p_format=p_format
        ):
            prompt = str(
                tokenizer.apply_chat_template(messages, tools=agent.TOOLS, add_generation_prompt=True, tokenize=False)
            )
            if not prompt.startswith(text):
                raise ValueError("the chat template rewrites earlier calls: the warm start cannot stitch them")
            new = encode(prompt[len(text) :])
            if "tool_call" in said:
                query = json.loads(said["tool_call"])["query"]
                completion = lookup_call(query)
                word = encode(query)
            else:
                completion = said["text"]
                word = encode(" " + completion.rstrip(".").split()[-1])
            out = encode(completion + end)
            trained = answer_weights(out, word, answer_weight, completion)
            if "tool_call" in said:  # the call's syntax too: a base model that can use its tool (the module says why)
                trained = [answer_weight] * len(trained)
            ids += new + out
            weights += [0.0] * len(new) + trained
            text = prompt + completion + end
        return Example(ids, weights)

    return example


def demo_corpus(words: list[str], settings: DemoSettings) -> Corpus:
    return corpus(
        words,
        p_lookup=settings.warm_p_lookup,
        p_correct=settings.warm_p_correct,
        p_format=settings.warm_p_format,
        answer_weight=settings.warm_answer_weight,
    )


TASK = DemoTask(
    "tools",
    agent_command,
    functools.partial(make_tasks, form=tool_task),
    demo_corpus,
    defaults={
        "warm_up_steps": 300,
        "warm_steps": 300,
        "warm_batch_size": 32,
        "warm_examples": 2000,
        "lr": 1e-3,
        "warm_p_correct": 0.8,
        "eval_group_size": 2,
    },
    warm_up=number_corpus,
)
