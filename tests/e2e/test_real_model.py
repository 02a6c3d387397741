"""Every route on a real pretrained model: SmolLM2-135M-Instruct (`lcap init-model --from smollm2`) on vLLM CPU.

One converted checkpoint (cached across sessions, `smollm2_dir`) and one `lcap serve` for the module
(`smollm2_server`). The tiny random model lets pass what a real BPE tokenizer and template can break: merges
across the template's joins, a tool call spelled in several tokens, the assistant's answer rendered again. The
tests assert what lcap guarantees (exact ids, logprobs, stitching, stored rows), never the
model's wording; the one steer is asking the model to repeat a tool call, which it does. Answers are greedy and
short: decode on this model runs at about ten tokens a second here.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fixtures_capture import turns
from policy_agents import episode_samples, extends_previous, sdk_clients

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a fact up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]
ECHO = "Repeat the user's message exactly."


def tool_call_text(query: str) -> str:
    """A tool call as the template (and vLLM's hermes parser) writes it: the model repeats it when asked to."""
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"query": "{query}"}}}}\n</tool_call>'


def check_tokens(row: dict, served: str) -> None:
    assert row["status_code"] == 200, row["error"]
    assert row["token_source"] == "vllm" and row["deployment"] == served, row["dialect"]
    ids, logprobs = row["completion_token_ids"], row["completion_logprobs"]
    assert len(ids) > 0 and len(logprobs) == len(ids), row["dialect"]
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs), row["dialect"]


def test_every_dialect_exact_ids_and_logprobs(smollm2_policy, tmp_path, capture_home):
    """Chat completions, completions, Responses and Messages, each plain and streamed, through the proxy: the
    stored prompt ids are vLLM's own rendering of the request, the completion ids decode to the text the agent
    got, every sampled token has a finite logprob, and a streamed answer has the plain one's ids (greedy)."""
    server = smollm2_policy
    db = tmp_path / "lcap.duckdb"
    question = [{"role": "user", "content": "Name one colour."}]
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        oa, an = sdk_clients(proxy, "dialects")
        chat = dict(model="gpt-4o", messages=question, max_tokens=6, temperature=0)
        plain = oa.chat.completions.create(**chat)
        streamed = "".join(
            c.choices[0].delta.content or "" for c in oa.chat.completions.create(**chat, stream=True) if c.choices
        )
        text = dict(model="gpt-3.5-turbo-instruct", prompt="The capital of France is", max_tokens=6, temperature=0)
        oa.completions.create(**text)
        list(oa.completions.create(**text, stream=True))
        responses = dict(model="gpt-5", input="Name one colour.", max_output_tokens=6, temperature=0)
        oa.responses.create(**responses)
        list(oa.responses.create(**responses, stream=True))
        messages = dict(model="claude-sonnet-4-5", messages=question, max_tokens=6, temperature=0)
        an.messages.create(**messages)
        with an.messages.stream(**messages) as stream:
            final = stream.get_final_message()
    assert plain.choices[0].message.content == streamed
    assert final.usage.output_tokens > 0

    rows = turns(db)
    assert [(r["dialect"], r["stream"]) for r in rows] == [
        (dialect, stream) for dialect in ("chat", "completions", "responses", "messages") for stream in (False, True)
    ]
    vllm = httpx.Client(base_url=server.url, timeout=60)
    chat_prompt = vllm.post(
        "/tokenize", json={"model": server.served_model, "messages": question, "add_generation_prompt": True}
    ).json()["tokens"]
    text_prompt = vllm.post("/tokenize", json={"model": server.served_model, "prompt": text["prompt"]}).json()["tokens"]
    for row in rows:
        check_tokens(row, server.served_model)
        if row["dialect"] in ("chat", "messages", "responses"):
            assert row["prompt_token_ids"] == chat_prompt, row["dialect"]
        else:
            assert row["prompt_token_ids"] == text_prompt
        if row["finish_reason"] == "length" and row["dialect"] in ("chat", "completions"):
            decoded = vllm.post(
                "/detokenize", json={"model": server.served_model, "tokens": row["completion_token_ids"]}
            ).json()["prompt"]
            assert decoded == row["completion_text"], row["dialect"]
    for plain_row, stream_row in zip(rows[::2], rows[1::2]):
        assert plain_row["completion_token_ids"] == stream_row["completion_token_ids"], plain_row["dialect"]
        assert plain_row["completion_logprobs"] == pytest.approx(stream_row["completion_logprobs"], abs=1e-4)


def test_tool_call_parsed_streamed_and_stitched(smollm2_policy, tmp_path, capture_home):
    """The model writes a tool call (asked to repeat one): vLLM's hermes parser finds it in SmolLM2's tokens,
    plain and streamed ('<tool_call>' is five tokens here, not one added token); the agent sends it back with the
    tool's result, and that call is stitched onto the model's exact ids, its prompt rendered by the template's tool
    sections. Then a four-call tool agent: every call after one that ended on a stop token merges."""
    server = smollm2_policy
    db = tmp_path / "lcap.duckdb"
    messages: list = [{"role": "system", "content": ECHO}, {"role": "user", "content": tool_call_text("france")}]
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        oa, _ = sdk_clients(proxy, "tool-ep")
        common = dict(model="gpt-4o", tools=TOOLS, max_tokens=40, temperature=0)
        answer = oa.chat.completions.create(messages=messages, **common)
        chunks = list(oa.chat.completions.create(messages=messages, stream=True, **common))
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls", message
        (call,) = message.tool_calls
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"query": "france"}
        streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert streamed[0].function.name == "lookup"
        assert json.loads("".join(d.function.arguments or "" for d in streamed)) == {"query": "france"}
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()

        # the harness's history: the call as it got it, the tool's answer, then the user again (three more calls)
        for turn, query in enumerate(("germany", "spain", "italy")):
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [c.model_dump() for c in message.tool_calls or ()],
                }
            )
            if message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": f"Fact {turn}."})
            messages.append({"role": "user", "content": tool_call_text(query)})
            answer = oa.chat.completions.create(messages=messages, **common)
            message = answer.choices[0].message

    rows = turns(db)
    assert len(rows) == 5
    for row in rows:
        check_tokens(row, server.served_model)
    calls = [[(c["name"], json.loads(c["arguments"])) for c in r["tool_calls"]] for r in rows[:2]]
    assert calls == [[("lookup", {"query": "france"})]] * 2
    assert rows[0]["completion_token_ids"] == rows[1]["completion_token_ids"]
    tokenizer_text = httpx.post(
        f"{server.url}/detokenize",
        json={"model": server.served_model, "tokens": rows[2]["prompt_token_ids"]},
        timeout=60,
    ).json()["prompt"]
    assert "<tools>" in tokenizer_text and "<tool_response>\nFact 0.\n</tool_response>" in tokenizer_text

    agent = [rows[0], *rows[2:]]  # the streamed repeat of the first call is another thread of the episode
    ended = [r["finish_reason"] in ("stop", "tool_calls") for r in agent]
    assert ended[0]
    assert [r["stitched"] for r in agent] == [False, *ended[:-1]], [r["stitch_note"] for r in agent]
    assert all(extends_previous([a, b]) == [True] for a, b in itertools.pairwise(agent) if b["stitched"])
    merged = sum(r["stitched"] for r in agent[1:])
    print(
        f"\nSmolLM2 echo tool agent: {merged} of {len(agent) - 1} follow-up calls merged; finish {[r['finish_reason'] for r in agent]}"
    )


def test_bundled_tool_agent_merge_rate(smollm2_policy, tmp_path, capture_home):
    """scripts/agents/openai_tools.py through `lcap proxy` on the real model, greedy: each call after one that
    ended on a stop token is stitched onto it, and the episode is as many samples as build-dataset's merge makes
    of calls cut by the token limit. The merge rate is printed (a figure for the benchmarks, not a bound)."""
    db = tmp_path / "lcap.duckdb"
    agent = [sys.executable, str(ROOT / "scripts/agents/openai_tools.py"), "--question", "capital of france"]
    agent += ["--model", "gpt-4o", "--turns", "4", "--max-tokens", "24", "--temperature", "0"]
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lcap"), "proxy", "--db", str(db), "--upstream", "policy", "--", *agent],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OPENAI_API_KEY": "sk-test"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = turns(db)
    assert len(rows) == 4
    for row in rows:
        check_tokens(row, smollm2_policy.served_model)
    ended = [r["finish_reason"] in ("stop", "tool_calls") for r in rows]
    assert [r["stitched"] for r in rows] == [False, *ended[:-1]], [r["stitch_note"] for r in rows]
    assert all(extends_previous([a, b]) == [True] for a, b in itertools.pairwise(rows) if b["stitched"])
    (samples,) = episode_samples(db).values()
    assert samples == 1 + ended[:-1].count(False)
    print(
        f"\nSmolLM2 bundled tool agent: {len(rows) - samples} of {len(rows) - 1} follow-up calls merged;"
        f" finish {[r['finish_reason'] for r in rows]}"
    )
