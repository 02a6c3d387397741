"""The bounded store of served responses behind `previous_response_id` (serve/vllm_plugin/lcap_policy/
responses_store.py), on plain values: its count and age bounds, oldest out first, a miss saying which bound
dropped the response, and the options `lcap serve` hands it. tests/e2e/test_policy_route.py runs it on the real server.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from lcap.serve.options import ServeOptions

PLUGIN = Path(__file__).resolve().parents[2] / "serve" / "vllm_plugin"


@pytest.fixture(scope="module")
def store_module():
    sys.path.insert(0, str(PLUGIN))
    try:
        yield importlib.import_module("lcap_policy.responses_store")
    finally:
        sys.path.remove(str(PLUGIN))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_count_bound_drops_the_oldest(store_module):
    store = store_module.ResponseStore(3, 60.0, clock=Clock())
    for i in range(5):
        store.put(f"r{i}", [{"i": i}], None)
    assert len(store) == 3
    for kept in ("r2", "r3", "r4"):
        assert store.get(kept)[0] is not None
    stored, why = store.get("r0")
    assert stored is None and "more than 3 responses were served after it" in why
    assert store.stats == {"stored": 5, "resolved": 3, "missed": 1, "evicted": 2, "expired": 0, "over_bytes": 0}


def test_age_bound_expires(store_module):
    clock = Clock()
    store = store_module.ResponseStore(100, 10.0, clock=clock)
    store.put("old", [1], '{"ids": [1]}')
    clock.now = 5.0
    store.put("young", [2], None)
    clock.now = 12.0
    assert store.get("old") == (None, "it was older than 10 s")
    young, _ = store.get("young")
    assert young is not None and young.history == (2,) and young.head is None
    assert len(store) == 1 and store.stats["expired"] == 1


def test_a_miss_never_served_here_and_the_reasons_are_bounded_too(store_module):
    store = store_module.ResponseStore(2, 60.0, clock=Clock())
    assert "not served by this policy server" in store.get("resp_x")[1]
    for i in range(10):
        store.put(f"r{i}", [], None)
    assert len(store._gone) <= 2  # what it remembers of dropped ids is as bounded as the store


def test_zero_keeps_nothing(store_module):
    store = store_module.ResponseStore(0, 60.0)
    store.put("r", [1], None)
    assert len(store) == 0 and store.get("r")[0] is None


def test_history_shares_the_items_of_the_call_it_extends(store_module):
    """A conversation's text is held once: each entry's history holds the same item objects as the one before."""
    store = store_module.ResponseStore(10, 60.0)
    first = [{"type": "message", "role": "user", "content": "x" * 1000}]
    store.put("r1", first, None)
    previous, _ = store.get("r1")
    store.put("r2", [*previous.history, {"type": "message", "role": "user", "content": "more"}], None)
    later, _ = store.get("r2")
    assert later.history[0] is first[0]


def test_serve_options_reach_the_store(store_module):
    env = ServeOptions(responses_max=7, responses_max_age=30, responses_max_bytes=1 << 20).endpoint_env()
    assert set(env) == {store_module.MAX_RESPONSES_ENV, store_module.MAX_AGE_ENV, store_module.MAX_BYTES_ENV}
    store = store_module.from_env(env)
    assert (store.max_responses, store.max_age, store.max_bytes) == (7, 30.0, 1 << 20)
    assert store_module.from_env({}) is None


def test_input_items(store_module):
    assert store_module.input_items("hi") == [{"type": "message", "role": "user", "content": "hi"}]
    assert store_module.input_items(None) == [] and store_module.input_items([{"a": 1}]) == [{"a": 1}]


def test_byte_bound_drops_the_oldest_and_counts_shared_items_once(store_module):
    """Heads (exact ids as JSON) grow with a conversation: past max_bytes the oldest go, whatever the count allows;
    items an entry shares with the one it extends are counted once."""
    text = {"type": "message", "role": "user", "content": "x" * 1000}
    size = len(json.dumps(text))
    store = store_module.ResponseStore(100, 60.0, max_bytes=size + 3 * 500, clock=Clock())
    history: list = [text]
    for i in range(5):  # one conversation: each entry holds the items before it, and a head of 500 bytes
        store.put(f"r{i}", history, "h" * 500)
        history = [*store.get(f"r{i}")[0].history]
    assert len(store) == 3 and store.bytes == size + 3 * 500
    stored, why = store.get("r0")
    assert stored is None and f"held more than {size + 1500} bytes" in why
    assert store.stats["over_bytes"] == 2 and "bytes in all" in store.limits()
    store._expire(float("inf"))  # every entry goes: what they held goes with them
    assert len(store) == 0 and store.bytes == 0 and store._items == {}


def test_an_entry_larger_than_the_byte_bound_is_not_kept(store_module):
    store = store_module.ResponseStore(100, 60.0, max_bytes=100, clock=Clock())
    store.put("big", [{"content": "y" * 200}], None)
    assert len(store) == 0 and store.bytes == 0 and "more than 100 bytes" in store.get("big")[1]


def test_an_empty_answer_is_kept_as_an_empty_assistant_message(store_module):
    """vLLM leaves an empty answer's message out of the output (or sends it without content): kept as it is, the
    next call's history would have no assistant turn to stitch onto."""
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yes"}]}
    call = {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"}
    assert store_module.answer_items([said]) == [said]
    assert store_module.answer_items([call]) == [call]
    for empty in ([], [{"type": "message", "role": "assistant", "content": []}]):
        (kept,) = store_module.answer_items(empty)
        assert kept["role"] == "assistant" and kept["content"] == [
            {"type": "output_text", "text": "", "annotations": []}
        ]
