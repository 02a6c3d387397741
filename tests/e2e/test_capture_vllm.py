"""Token ids from the real vLLM CPU server: what lcap stores is what vLLM tokenized and sampled.

The agent (httpx through the proxy, as an SDK would) calls api.openai.com; `--upstream policy`
routes it to the session's vLLM serving the tiny model. The stored prompt ids must equal vLLM's
own /tokenize of the same request, the completion ids must decode to the text the agent got,
and the agent's answer must not carry what lcap added.
"""

from __future__ import annotations

import json
import ssl

import httpx
import pytest
from fixtures_capture import turns

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "Write one short word."}]


def _sse(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and "[DONE]" not in line]


def test_token_ids_match_vllm(vllm_policy, tmp_path, capture_home, monkeypatch):
    server = vllm_policy
    db = tmp_path / "lcap.duckdb"
    opts = {"max_tokens": 8, "temperature": 0}
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        assert proxy.token_ids
        env = proxy.child_env("vllm-ep", base={})
        with httpx.Client(
            proxy=env["HTTPS_PROXY"], verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"]), timeout=120
        ) as client:
            chat = "https://api.openai.com/v1/chat/completions"
            plain = client.post(chat, json={"model": "gpt-4o", "messages": MESSAGES, **opts}).json()
            streamed = _sse(
                client.post(chat, json={"model": "gpt-4o", "messages": MESSAGES, "stream": True, **opts}).text
            )
            legacy = client.post(
                "https://api.openai.com/v1/completions",
                json={"model": "gpt-3.5-turbo-instruct", "prompt": "Once upon", **opts},
            ).json()
            legacy_stream = _sse(
                client.post(
                    "https://api.openai.com/v1/completions",
                    json={"model": "x", "prompt": "Once upon", "stream": True, **opts},
                ).text
            )
            response = client.post(
                "https://api.openai.com/v1/responses",
                json={"model": "gpt-4.1", "input": MESSAGES[0]["content"], "max_output_tokens": 8, "temperature": 0},
            ).json()
    # the agent saw plain OpenAI answers
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0].get("logprobs") is None
    assert all(
        "token_ids" not in json.dumps(c) and not (c.get("choices") and c["choices"][0].get("logprobs"))
        for c in streamed
    )
    assert "token_ids" not in legacy["choices"][0] and legacy["choices"][0].get("logprobs") is None
    assert all("token_ids" not in json.dumps(c) for c in legacy_stream)
    assert "input_messages" not in response and "output_messages" not in response

    rows = turns(db)
    assert [(r["dialect"], r["stream"]) for r in rows] == [
        ("chat", False),
        ("chat", True),
        ("completions", False),
        ("completions", True),
        ("responses", False),
    ]
    vllm = httpx.Client(base_url=server.url, timeout=60)
    chat_prompt = vllm.post(
        "/tokenize", json={"model": server.served_model, "messages": MESSAGES, "add_generation_prompt": True}
    ).json()["tokens"]
    text_prompt = vllm.post("/tokenize", json={"model": server.served_model, "prompt": "Once upon"}).json()["tokens"]
    for row, prompt in zip(rows, (chat_prompt, chat_prompt, text_prompt, text_prompt, chat_prompt)):
        assert row["token_source"] == "vllm", row["dialect"]
        assert row["deployment"] == server.served_model and row["model_served"] == server.served_model
        assert row["prompt_token_ids"] == prompt, row["dialect"]
        ids = row["completion_token_ids"]
        assert 0 < len(ids) <= 8
        decoded = vllm.post("/detokenize", json={"model": server.served_model, "tokens": ids}).json()["prompt"]
        if row["finish_reason"] == "length":  # no stop token to strip: the text is exactly the ids
            assert decoded == row["completion_text"], row["dialect"]
        if row["dialect"] != "responses":
            assert len(row["completion_logprobs"]) == len(ids)
            assert all(lp <= 0 for lp in row["completion_logprobs"])
    # the same greedy answer, streamed or not
    assert rows[0]["completion_token_ids"] == rows[1]["completion_token_ids"]
    assert rows[2]["completion_token_ids"] == rows[3]["completion_token_ids"]
    assert plain["choices"][0]["message"]["content"] == rows[0]["completion_text"]
