"""The policy route on the real vLLM CPU server with lcap's endpoints (`lcap serve` loads them): stitched prompts,
exact tokens in every dialect, adaptation, each through the SDK a harness would use.

The tiny model is random; `logit_bias` on its stop token (id of <|im_end|>) makes its answers end on a stop
token within a few tokens, as a trained model's do: only such a turn can be extended token for token.
"""

from __future__ import annotations

import itertools
import json
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

pytestmark = pytest.mark.vllm

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


_WS_ENDS = ("response.completed", "response.incomplete", "response.failed", "error")


def _stop_id(server) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir).convert_tokens_to_ids("<|im_end|>")


def _user_item(text: str) -> dict:
    """A Responses input message from the user, as Codex writes one."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _brief_codex(server, stop_bias: float) -> dict:
    """Responses arguments as Codex sends them (store false), short answers steered by `stop_bias`."""
    return dict(
        model="gpt-5-codex",
        instructions="Be brief.",
        max_output_tokens=32,
        store=False,
        extra_body={"logit_bias": {str(_stop_id(server)): stop_bias}},
    )


def test_chat_stitched_streaming_and_not(vllm_policy, tmp_path, capture_home):
    server = vllm_policy
    bias = {str(_stop_id(server)): 6}
    db = tmp_path / "lcap.duckdb"
    messages: list[dict] = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is x?"}]
    seen_chunks: list = []
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        oa, _ = sdk_clients(proxy, "chat-ep")
        for call in range(3):
            kwargs = dict(model="gpt-4o", messages=messages, tools=TOOLS, max_tokens=16, logit_bias=bias, seed=call)
            if call == 1:  # streamed, as an agent asks, with usage
                chunks = list(oa.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
                seen_chunks = chunks
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            else:
                answer = oa.chat.completions.create(**kwargs)
                text = answer.choices[0].message.content or ""
                assert answer.usage.completion_tokens > 0
                assert getattr(answer, "prompt_token_ids", None) is None  # lcap's own fields stay with lcap
            # the harness re-serialises what it got (extra whitespace), then adds a tool result
            messages = [*messages, {"role": "assistant", "content": f" {text}  "}]
            messages.append({"role": "user", "content": f"Observation {call}: x is {call}"})
    assert not any("lcap" in json.dumps(c.model_dump()) for c in seen_chunks)
    rows = turns(db)
    assert [r["stream"] for r in rows] == [False, True, False]
    assert all(r["status_code"] == 200 and r["token_source"] == "vllm" for r in rows)
    assert all(r["finish_reason"] == "stop" for r in rows), "the stop token's bias no longer ends the answers"
    assert [r["stitched"] for r in rows] == [False, True, True]
    assert [r["stitched_from"] for r in rows[1:]] == [rows[0]["turn_id"], rows[1]["turn_id"]]
    assert [r["thread_seq"] for r in rows] == [0, 0, 0]
    assert extends_previous(rows) == [True, True]
    assert all(len(r["completion_logprobs"]) == len(r["completion_token_ids"]) for r in rows)

    # --no-stitch: the same conversation is rendered from its messages, as vLLM's own endpoint does
    db2 = tmp_path / "off.duckdb"
    with CaptureProxy(Store(db2), ProxyOptions(upstream="policy", stitch=False)) as proxy:
        oa, _ = sdk_clients(proxy, "chat-off")
        oa.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS, max_tokens=4, logit_bias=bias)
    (row,) = turns(db2)
    assert row["stitched"] is False and row["stitched_from"] is None
    rendered = httpx.post(
        f"{server.url}/tokenize",
        json={"model": server.served_model, "messages": messages, "tools": TOOLS, "add_generation_prompt": True},
        timeout=60,
    ).json()["tokens"]
    assert row["prompt_token_ids"] == rendered
    assert rendered[: len(rows[2]["prompt_token_ids"])] != rows[2]["prompt_token_ids"]  # re-rendering drifted


def test_messages_and_responses_exact_ids(vllm_policy, tmp_path, capture_home):
    server = vllm_policy
    stop = _stop_id(server)
    db = tmp_path / "lcap.duckdb"
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        oa, an = sdk_clients(proxy, "dialects-ep")
        # Anthropic Messages, as Claude Code sends it: thinking, metadata, cache marks, and a max_tokens past the
        # policy's context (Claude Code's 64000 fits the tiny model's 64k positions; a frontier model's may not)
        system = [{"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}]
        history: list = [{"role": "user", "content": [{"type": "text", "text": "What is x?"}]}]
        tools = [{"name": "lookup", "description": "Look up.", "input_schema": TOOLS[0]["function"]["parameters"]}]
        common = dict(
            model="claude-sonnet-4-5",
            max_tokens=200_000,
            system=system,
            tools=tools,
            metadata={"user_id": "u1"},
            thinking={"type": "enabled", "budget_tokens": 31999},
            extra_body={"logit_bias": {str(stop): 6}},
        )
        first = an.messages.create(messages=history, **common)
        assert first.type == "message" and first.stop_reason in ("end_turn", "tool_use")
        history += [
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
            {"role": "user", "content": [{"type": "text", "text": "Observation: x is 3"}]},
        ]
        with an.messages.stream(messages=history, **common) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start" and "message_stop" in kinds and final.usage.output_tokens > 0

        # Responses, as Codex sends it: store false, a reasoning effort, encrypted reasoning asked for
        items: list = [_user_item("What is x?")]
        rcommon = dict(
            model="gpt-5-codex",
            instructions="Use tools.",
            tools=[{"type": "function", "name": "lookup", "parameters": TOOLS[0]["function"]["parameters"]}],
            max_output_tokens=100000,
            store=False,
            include=["reasoning.encrypted_content"],
            extra_body={"logit_bias": {str(stop): 6}},
        )
        answer = oa.responses.create(input=items, **rcommon)
        assert answer.status == "completed"
        items += [o.model_dump(exclude_none=True) for o in answer.output]
        items.append(_user_item("Observation"))
        events = [event.type for event in oa.responses.create(input=items, stream=True, **rcommon)]
        assert events[0] == "response.created" and events[-1] == "response.completed"

    rows = turns(db)
    assert [(r["dialect"], r["stream"]) for r in rows] == [
        ("messages", False),
        ("messages", True),
        ("responses", False),
        ("responses", True),
    ]
    for row in rows:
        assert row["status_code"] == 200, row["error"]
        assert row["token_source"] == "vllm" and row["deployment"] == server.served_model, row["dialect"]
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0
        assert all(lp <= 0 for lp in row["completion_logprobs"])
    assert [r["stitched"] for r in rows] == [False, True, False, True], [r["stitch_note"] for r in rows]
    assert extends_previous(rows[:2]) == [True] and extends_previous(rows[2:]) == [True]
    adapted = [{a["field"]: a["action"] for a in json.loads(r["adaptations"])} for r in rows]
    for row, changes in zip(rows, adapted):
        assert changes["model"] == "mapped", row["dialect"]
    assert adapted[0]["max_tokens"] == "clamped" and adapted[0]["thinking"] == "dropped"
    assert adapted[2]["max_output_tokens"] == "clamped"


def test_adaptation_off_gets_vllms_answer(vllm_policy, tmp_path, capture_home):
    """--no-adapt sends the request as the agent wrote it: vLLM's own 400 reaches the agent (and the store)."""
    import anthropic

    db = tmp_path / "lcap.duckdb"
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy", adapt=False)) as proxy:
        _, an = sdk_clients(proxy, "no-adapt")
        with pytest.raises(anthropic.BadRequestError):
            an.messages.create(
                model="claude",
                max_tokens=200_000,  # past the policy's context: vLLM refuses it
                messages=[{"role": "user", "content": "hi"}],
                metadata={"user_id": "u"},
            )
    (row,) = turns(db)
    assert row["status_code"] == 400 and row["adaptations"] is not None  # only the model's name was mapped
    assert [a["field"] for a in json.loads(row["adaptations"])] == ["model"]


@pytest.mark.slow
def test_tool_agent_one_sample_per_episode(vllm_policy, tmp_path, capture_home):
    """The bundled tool agent through `lcap proxy`: every call after one that ended on a stop token is stitched
    onto it, and an episode is one sample but where a call was cut by the token limit (which ends a sample).
    Before and after (--no-stitch) on the same agent: benchmarks/bench_stitching.py."""
    bias = json.dumps({str(_stop_id(vllm_policy)): 6})
    db = tmp_path / "lcap.duckdb"
    for question in ("capital of france", "largest planet"):
        agent = [sys.executable, str(ROOT / "scripts/agents/openai_tools.py"), "--question", question]
        agent += ["--model", "gpt-4o", "--turns", "4", "--max-tokens", "24", "--logit-bias", bias]
        done = subprocess.run(
            [str(Path(sys.executable).parent / "lcap"), "proxy", "--db", str(db), "--upstream", "policy", "--", *agent],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OPENAI_API_KEY": "sk-test"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
    rows = turns(db)
    assert len(rows) == 8 and all(r["status_code"] == 200 and r["token_source"] == "vllm" for r in rows)
    samples = episode_samples(db)
    for episode in samples:
        mine = [r for r in rows if r["episode_id"] == episode]
        ended = [r["finish_reason"] in ("stop", "tool_calls") for r in mine]
        assert [r["stitched"] for r in mine] == [False, *ended[:-1]], [r["stitch_note"] for r in mine]
        assert all(extends_previous([a, b]) == [True] for a, b in itertools.pairwise(mine) if b["stitched"])
        assert samples[episode] == 1 + ended[:-1].count(False)


def test_responses_websocket_exact_ids_and_stitched(vllm_policy, tmp_path, capture_env):
    """Codex's transport: Responses over a WebSocket through `lcap proxy`, a warm-up frame then three calls, the
    last continuing by previous_response_id."""
    db = capture_env["LCAP_DB"]
    env = {**capture_env, "OPENAI_API_KEY": "sk-test", "LOGIT_BIAS": json.dumps({str(_stop_id(vllm_policy)): 6})}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lcap"), "proxy", "--upstream", "policy", "--"]
        + [sys.executable, str(ROOT / "tests/agents_capture/ws_policy_agent.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    events = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("event: ")]
    ends = [e for e in events if e in ("response.completed", "response.incomplete")]
    assert len(ends) == 4 and not any("lcap" in e for e in events)  # the warm-up's, then the three calls'
    rows = turns(db)
    assert [(r["transport"], r["status_code"]) for r in rows] == [("websocket", 200)] * 3
    for row in rows:
        assert row["token_source"] == "vllm" and len(row["completion_logprobs"]) == len(row["completion_token_ids"])
    # the second call extends the first when the first ended on a stop token (else the agent resent it as it was)
    first_ended, second_ended = ends[1] == "response.completed", ends[2] == "response.completed"
    # the third, by previous_response_id, is the whole conversation from lcap's store, on the second's exact ids
    assert [r["stitched"] for r in rows] == [False, first_ended, second_ended], [r["stitch_note"] for r in rows]
    assert extends_previous(rows) == [first_ended, second_ended]
    assert rows[2]["request"]["previous_response_id"]


def test_responses_previous_response_id_resolved_and_stitched(vllm_policy, tmp_path, capture_home):
    """A call that continues by previous_response_id sends only what is new (Codex over its WebSocket): lcap's
    bounded store of served responses makes it the whole conversation, stitched onto the previous turn's exact ids.
    An id the store does not hold gets a 404 naming the store's bounds, counted on /lcap/v1/info."""
    import openai

    server = vllm_policy
    before = httpx.get(f"{server.url}/lcap/v1/info", timeout=10).json()["responses"]
    db = tmp_path / "lcap.duckdb"
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        oa, _ = sdk_clients(proxy, "previous-ep")
        common = _brief_codex(server, 6)
        ask = [_user_item("What is x?")]
        # an empty answer (only the stop token): vLLM's output has no message, lcap's store keeps an empty one
        first = oa.responses.create(input=ask, **{**common, "extra_body": {"logit_bias": {str(_stop_id(server)): 100}}})
        assert first.status == "completed" and first.output_text == ""
        more = [_user_item("And y?")]
        second = oa.responses.create(input=more, previous_response_id=first.id, **common)
        assert second.status in ("completed", "incomplete")
        with pytest.raises(openai.NotFoundError) as missing:
            oa.responses.create(input=more, previous_response_id="resp_never_served", **common)
    message = str(missing.value)
    assert "not in lcap's response store" in message and "--responses-max" in message, message
    after = httpx.get(f"{server.url}/lcap/v1/info", timeout=10).json()["responses"]
    assert after["resolved"] - before["resolved"] == 1 and after["missed"] - before["missed"] == 1

    rows = turns(db)
    assert [r["status_code"] for r in rows] == [200, 200, 404]
    assert [r["stitched"] for r in rows[:2]] == [False, True], [r["stitch_note"] for r in rows]
    assert extends_previous(rows[:2]) == [True]
    # the resolved prompt holds the first call's question: the history came from the store, not the request
    assert len(rows[1]["prompt_token_ids"]) > len(rows[0]["prompt_token_ids"])
    assert rows[1]["token_source"] == "vllm" and len(rows[1]["completion_logprobs"]) == len(
        rows[1]["completion_token_ids"]
    )


def test_an_empty_responses_answer_comes_back_as_an_empty_message(vllm_policy, tmp_path, capture_home):
    """The model answering only its stop token: vLLM's Responses output has no message for it, so a harness that
    sends its output back (Codex, store false) would have nothing after its question and the next call could not
    be stitched. lcap's answer holds one empty assistant message, in the response and (streamed) as items."""
    server = vllm_policy
    db = tmp_path / "lcap.duckdb"
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        oa, _ = sdk_clients(proxy, "empty-ep")
        common = _brief_codex(server, 100)
        items: list = [_user_item("What is x?")]
        first = oa.responses.create(input=items, **common)
        assert first.status == "completed" and first.output_text == ""
        assert [(o.type, o.role, [c.text for c in o.content]) for o in first.output] == [("message", "assistant", [""])]
        items += [o.model_dump(exclude_none=True) for o in first.output] + [_user_item("And y?")]
        events = list(oa.responses.create(input=items, stream=True, **common))
        numbers = [event.sequence_number for event in events]
        assert numbers == sorted(set(numbers)), numbers
        streamed = [event.item for event in events if event.type == "response.output_item.done"]
        assert [(o.type, [c.text for c in o.content]) for o in streamed] == [("message", [""])]
        assert events[-1].type == "response.completed" and events[-1].response.output == streamed
        items += [o.model_dump(exclude_none=True) for o in streamed] + [_user_item("And z?")]
        assert oa.responses.create(input=items, **common).status == "completed"

    rows = turns(db)
    assert [r["completion_token_ids"] for r in rows] == [[_stop_id(server)]] * 3
    assert [r["stitched"] for r in rows] == [False, True, True], [r["stitch_note"] for r in rows]
    assert extends_previous(rows) == [True, True]


def test_a_websocket_call_past_the_context_gets_the_policys_reason(vllm_policy, tmp_path, capture_home):
    """Codex over its WebSocket with a prompt past the model's context: vLLM refuses it as it refuses the same call
    over HTTP (a 400), so the agent gets a Responses `error` event with that status and reason, the turn is stored
    with them (a failed call), and the socket goes on serving the next call."""
    import ssl

    from websockets.sync.client import connect

    server = vllm_policy
    max_model_len = httpx.get(f"{server.url}/lcap/v1/info", timeout=10).json()["max_model_len"]
    words = " ".join(f"w{i % 97}" for i in range(max_model_len + 1))  # each word is a token at least
    db = tmp_path / "lcap.duckdb"
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        env = proxy.child_env("too-long-ep", base={})
        tls = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
        with connect("wss://api.openai.com/v1/responses", proxy=env["HTTPS_PROXY"], ssl=tls, max_size=None) as ws:
            answers = []
            for text in (words, "Hi"):
                request = {"model": "gpt-5-codex", "input": [_user_item(text)], "max_output_tokens": 4, "store": False}
                ws.send(json.dumps({"type": "response.create", **request}))
                while (event := json.loads(ws.recv(timeout=300)))["type"] not in _WS_ENDS:
                    pass
                answers.append(event)
    refused, next_one = answers
    assert refused["type"] == "error" and refused["status"] == 400, refused
    assert "context" in refused["error"]["message"].lower() and "length" in refused["error"]["message"].lower()
    assert next_one["type"] in ("response.completed", "response.incomplete"), next_one

    rows = turns(db)
    assert [(r["transport"], r["status_code"]) for r in rows] == [("websocket", 400), ("websocket", 200)]
    assert rows[0]["error"] == refused["error"]["message"]
