"""Stitching's rule on plain values (no vLLM): what counts as extending the previous turn, the suffix a
template adds after it, the proxy's bounded store of heads, and the wire both sides speak.

The rule itself runs inside vLLM (serve/vllm_plugin/lcap_policy/stitch.py imports nothing of vLLM), so
these tests load it from there; tests/e2e/test_policy_route.py runs it on the real server.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from lcap.capture.routing import policy_wire
from lcap.capture.routing.stitching import ConversationHeads
from lcap.capture.routing.stitching import Head as ProxyHead

PLUGIN = Path(__file__).resolve().parents[2] / "serve" / "vllm_plugin"


@pytest.fixture(scope="module")
def plugin():
    sys.path.insert(0, str(PLUGIN))
    try:
        yield importlib.import_module("lcap_policy.stitch"), importlib.import_module("lcap_policy.wire")
    finally:
        sys.path.remove(str(PLUGIN))


TOOLS_CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"query": "x"}'}}
EARLIER = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is x?"}]


def _head(stitch, produced: dict, *, stop: int | None = 2):
    return stitch.Head(
        ids=[5, 6, 7, 8, 2],
        prompt_len=3,
        n=len(EARLIER),
        digests=stitch.message_digests(EARLIER),
        context="ctx",
        out=stitch.assistant_digest([produced]),
        stop=stop,
    )


def test_match_allows_reserialisation_only(plugin):
    stitch, _ = plugin
    produced = {"role": "assistant", "content": "Let me  look.", "tool_calls": [TOOLS_CALL]}
    head = _head(stitch, produced)
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "x is 3"}
    # the harness re-serialises: other whitespace, arguments re-dumped, a new call id, reasoning it kept
    resent = {
        "role": "assistant",
        "content": "Let me look.\n",
        "reasoning_content": "thinking",
        "tool_calls": [{**TOOLS_CALL, "id": "other", "function": {"name": "lookup", "arguments": '{ "query":"x" }'}}],
    }
    assert stitch.match(head, [*EARLIER, resent, tool], "ctx") == (3, "")
    # content null vs "" when there is no text
    quiet = _head(stitch, {"role": "assistant", "content": None, "tool_calls": [TOOLS_CALL]})
    assert (
        stitch.match(quiet, [*EARLIER, {"role": "assistant", "content": "", "tool_calls": [TOOLS_CALL]}, tool], "ctx")[
            0
        ]
        == 3
    )
    # what does not extend it
    changed = {**resent, "content": "Let me see."}
    assert stitch.match(head, [*EARLIER, changed, tool], "ctx")[0] is None
    other_args = {
        **resent,
        "tool_calls": [{**TOOLS_CALL, "function": {"name": "lookup", "arguments": '{"query":"y"}'}}],
    }
    assert stitch.match(head, [*EARLIER, other_args, tool], "ctx")[0] is None
    assert stitch.match(head, [EARLIER[0], {"role": "user", "content": "What is y?"}, resent, tool], "ctx")[0] is None
    assert stitch.match(head, [*EARLIER, resent, tool], "other tools")[0] is None
    assert stitch.match(head, [*EARLIER, resent], "ctx")[0] is None  # nothing after the assistant message
    assert stitch.match(_head(stitch, produced, stop=None), [*EARLIER, resent, tool], "ctx")[0] is None


def test_suffix_is_what_the_template_adds_after_the_assistant_message(plugin, tiny_model_dir):
    from transformers import AutoTokenizer

    stitch, _ = plugin
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [
        *EARLIER,
        {"role": "assistant", "content": "It is", "tool_calls": [TOOLS_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "x is 3"},
    ]
    prompt = tok.apply_chat_template(EARLIER, tokenize=False, add_generation_prompt=True)
    prefix = tok.apply_chat_template(messages[:3], tokenize=False)
    full = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_stops = tok.encode(prompt, add_special_tokens=False).count(stop)
    rest, why = stitch.suffix_text(prefix, full, "<|im_end|>", prompt_stops)
    assert why == "" and rest == "\n<|im_start|>user\n<tool_response>\nx is 3\n</tool_response><|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    # a history the template renders with more message ends than the previous prompt had: no suffix
    assert stitch.suffix_text(prefix, full, "<|im_end|>", prompt_stops + 1)[0] is None
    head = stitch.Head(ids=[1] * 10, prompt_len=5, n=2, digests=["a", "b"], context="", out="", stop=stop)
    ids, _ = stitch.stitched_ids(head, [7, 8], max_model_len=100)
    assert ids == [1] * 10 + [7, 8]
    assert stitch.stitched_ids(head, [7, 8], max_model_len=12)[0] is None  # no room left to generate


def test_head_parse_refuses_what_is_not_a_head(plugin):
    stitch, _ = plugin
    good = {"ids": [1, 2, 3], "prompt_len": 2, "n": 1, "digests": ["a"], "context": "", "out": "", "stop": 3}
    assert stitch.Head.parse(good).ids == [1, 2, 3]
    for bad in (
        [],
        {**good, "ids": [1, -2, 3]},
        {**good, "ids": [1, True, 3]},
        {**good, "prompt_len": 4},
        {**good, "digests": []},
        {k: v for k, v in good.items() if k != "out"},
    ):
        with pytest.raises(ValueError):
            stitch.Head.parse(bad)


def test_wire_constants_agree(plugin):
    _, wire = plugin
    for name in ("PREFIX", "REQUEST_KEY", "RECORD_EVENT", "HEAD_EVENT", "INFO_PATH", "VERSION"):
        assert getattr(policy_wire, name) == getattr(wire, name), name
    assert all(path.startswith(wire.PREFIX + "/v1/") for path in policy_wire.PATHS.values())


def test_temperature_override_reaches_the_request(plugin):
    """`--temperature T`: the proxy carries T in lcap's member and the endpoints set it over the agent's, recorded."""
    adapt = importlib.import_module("lcap_policy.adapt")
    sent = json.loads(
        policy_wire.request_body(b'{"temperature":1.3}', adapt=True, stitch=True, head=None, temperature=0)
    )
    body = {k: v for k, v in sent.items() if k != "lcap"}
    change = adapt.override_temperature(body, sent["lcap"]["temperature"])
    assert body == {"temperature": 0.0} and (change["from"], change["to"]) == (1.3, 0.0)


def test_request_body_and_stream_parts():
    body = policy_wire.request_body(b'{"model":"m","messages":[]}', adapt=True, stitch=False, head=b'{"ids":[1]}')
    assert json.loads(body)["lcap"] == {"adapt": True, "stitch": False, "head": {"ids": [1]}, "temperature": None}
    assert json.loads(policy_wire.request_body(b"{}", adapt=False, stitch=True, head=None, temperature=0)) == {
        "lcap": {"adapt": False, "stitch": True, "head": None, "temperature": 0.0}
    }
    with pytest.raises(ValueError):
        policy_wire.request_body(b"[1]", adapt=True, stitch=True, head=None)

    got: list = []
    parts = policy_wire.SseParts(lambda record, head: got.append((record, head)), limit=1 << 20)
    stream = b'data: {"a":1}\n\nevent: lcap\ndata: {"stitched":true}\n\nevent: lcap-head\ndata: {"ids":[1]}\n\n'
    out = [piece for i in range(0, len(stream), 7) for piece in parts(stream[i : i + 7])] + parts(b"")
    assert b"".join(out) == b'data: {"a":1}\n\n'
    assert got == [(b'{"stitched":true}', None), (None, b'{"ids":[1]}')]
    # an event without an end within the limit goes out as it is: the agent's stream never waits on lcap
    small = policy_wire.SseParts(lambda *_: None, limit=8)
    assert small(b"data: a very long event") == [b"data: a very long event"]


def test_heads_are_bounded():
    heads = ConversationHeads(max_bytes=100)
    heads.put("e1", ProxyHead(b"x" * 40, key=1, items=3, turn_id="t1", thread_seq=0))
    assert heads.pick("e1", 1, 5).turn_id == "t1"
    assert heads.pick("e1", 1, 3) is None  # a call with no more messages than the head's cannot extend it
    assert heads.pick("e1", 2, 5) is None and heads.pick("e2", 1, 5) is None
    heads.put("e1", ProxyHead(b"y" * 40, key=1, items=5, turn_id="t2", thread_seq=0))  # replaces its conversation's
    assert len(heads) == 1 and heads.bytes == 40
    heads.put("e2", ProxyHead(b"z" * 40, key=1, items=3, turn_id="t3", thread_seq=0))
    heads.put("e3", ProxyHead(b"w" * 40, key=1, items=3, turn_id="t4", thread_seq=0))  # past 100 bytes: oldest go
    assert heads.bytes <= 100 and heads.pick("e1", 1, 9) is None and heads.pick("e3", 1, 9) is not None
    heads.put("e4", ProxyHead(b"v" * 101, key=1, items=3, turn_id="t5", thread_seq=0))  # larger than all: not kept
    assert heads.pick("e4", 1, 9) is None
    for key in range(10):  # conversations per episode are bounded too
        heads.put("e5", ProxyHead(b"", key=key, items=1, turn_id=f"k{key}", thread_seq=0))
    assert sum(1 for k in range(10) if heads.pick("e5", k, 9) is not None) == 8
    heads.forget("e5")
    assert heads.pick("e5", 9, 9) is None
