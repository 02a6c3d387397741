"""The real vLLM CPU server on the tiny model: token ids, chat template, tool calls."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

pytestmark = pytest.mark.vllm

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12 * 7"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "84"},
]
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]


def test_chat_token_ids_match_vllm_tokenize_and_the_template(vllm_policy):
    from transformers import AutoTokenizer

    body = {"model": vllm_policy.served_model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 6,
            "temperature": 0, "return_token_ids": True, "logprobs": True}
    answer = httpx.post(f"{vllm_policy.url}/v1/chat/completions", json=body, timeout=120).json()
    choice = answer["choices"][0]
    assert answer["model"] == vllm_policy.served_model
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"] > 0
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])

    tokenized = httpx.post(f"{vllm_policy.url}/tokenize", json={
        "model": vllm_policy.served_model, "messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": True,
    }, timeout=60).json()
    assert answer["prompt_token_ids"] == tokenized["tokens"]

    tokenizer = AutoTokenizer.from_pretrained(vllm_policy.model_dir)
    rendered = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_call>\n" + '{"name": "calculator", "arguments": {"expression": "12 * 7"}}' in rendered
    assert "# Tools" in rendered and "<tool_response>\n84\n</tool_response>" in rendered
    assert tokenizer(rendered, add_special_tokens=False)["input_ids"] == answer["prompt_token_ids"]


def test_template_tool_calls_parse_back_with_vllms_hermes_parser(vllm_policy):
    """What the template renders for an assistant tool call is what `--tool-call-parser hermes` reads."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_policy.model_dir)
    rendered = tokenizer.apply_chat_template(MESSAGES[:3], tools=TOOLS, tokenize=False)
    completion = rendered.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    script = f"""
import json, sys
from transformers import AutoTokenizer
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
parser = Hermes2ProToolParser(AutoTokenizer.from_pretrained({str(vllm_policy.model_dir)!r}))
info = parser.extract_tool_calls(sys.stdin.read(), request=None)
print(json.dumps([[c.function.name, json.loads(c.function.arguments)] for c in info.tool_calls]))
"""
    done = subprocess.run([vllm_policy.python, "-c", script], input=completion, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [["calculator", {"expression": "12 * 7"}]]
