"""End to end: an unmodified agent through `lcap proxy --upstream policy` to the real vLLM, then `lcap deploy`.

Runs once the capture stage's `lcap proxy` exists (skipped before, with that reason).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import httpx
import pytest

from lcap.cli import app

pytestmark = pytest.mark.vllm

AGENT = textwrap.dedent('''
    """A tool-using agent that knows nothing about lcap: openai SDK, default host, two calls."""
    import json
    from openai import OpenAI

    client = OpenAI(max_retries=0, timeout=120)
    tools = json.loads(%r)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12 * 7?"}]
    first = client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=tools, max_tokens=6, temperature=0)
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{\\"expression\\": \\"12 * 7\\"}"}}]})
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "84"})
    second = client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=tools, max_tokens=6, temperature=0)
    print(json.dumps({"answers": [first.choices[0].message.content, second.choices[0].message.content], "messages": messages}))
''')
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def stored_turns(db: Path, episode: str) -> list[dict]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        cur = con.execute("SELECT * FROM turns WHERE episode_id = ? ORDER BY seq", [episode])
        return [dict(zip([d[0] for d in cur.description], row)) for row in cur.fetchall()]
    finally:
        con.close()


def test_agent_through_lcap_proxy_to_the_policy_then_a_new_deployment(vllm_policy, tiny_lora, tmp_path):
    if "proxy" not in {(c.name or c.callback.__name__) for c in app.registered_commands}:
        pytest.skip("`lcap proxy` (capture stage) is not there yet")
    from transformers import AutoTokenizer

    from lcap.serve.deploy import deploy_policy
    from lcap.store import Store

    agent = tmp_path / "agent.py"
    agent.write_text(AGENT % json.dumps(TOOLS))
    db = tmp_path / "lcap.duckdb"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_BASE_URL", "NO_PROXY", "no_proxy")}
    env.update(OPENAI_API_KEY="sk-test-not-a-real-key", PYTHONUNBUFFERED="1")
    lcap = str(Path(sys.executable).parent / "lcap")

    def run_agent(episode: str) -> dict:
        done = subprocess.run(
            [
                lcap,
                "proxy",
                "--upstream",
                "policy",
                "--db",
                str(db),
                "--episode",
                episode,
                "--",
                sys.executable,
                str(agent),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    base_run = run_agent("on-base")
    base_turns = stored_turns(db, "on-base")
    assert len(base_turns) == 2
    tokenizer = AutoTokenizer.from_pretrained(vllm_policy.model_dir)
    messages = base_run["messages"]
    for turn, n_messages in zip(base_turns, (2, 4)):
        assert turn["deployment"] == vllm_policy.served_model and turn["model_requested"] == "gpt-4o-mini"
        assert turn["token_source"] == "vllm" and len(turn["completion_token_ids"]) == turn["completion_tokens"] > 0
        tokenized = httpx.post(
            f"{vllm_policy.url}/tokenize",
            json={
                "model": vllm_policy.served_model,
                "messages": messages[:n_messages],
                "tools": TOOLS,
                "add_generation_prompt": True,
            },
            timeout=60,
        ).json()["tokens"]
        assert turn["prompt_token_ids"] == tokenized
        assert (
            turn["prompt_token_ids"]
            == tokenizer.apply_chat_template(
                messages[:n_messages], tools=TOOLS, add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
    assert [t["completion_text"] for t in base_turns] == base_run["answers"]

    name = deploy_policy(tiny_lora, round=1, store=Store(db))
    lora_run = run_agent("on-lora")
    lora_turns = stored_turns(db, "on-lora")
    assert [t["deployment"] for t in lora_turns] == [name, name]
    assert lora_turns[0]["prompt_token_ids"] == base_turns[0]["prompt_token_ids"]
    assert (
        lora_turns[0]["completion_token_ids"] != base_turns[0]["completion_token_ids"]
    )  # temperature 0: the LoRA answers
    assert lora_run["answers"][0] == lora_turns[0]["completion_text"]
    deployments = duckdb.connect(str(db), read_only=True).execute("SELECT name, kind FROM deployments").fetchall()
    assert deployments == [(name, "lora")]
