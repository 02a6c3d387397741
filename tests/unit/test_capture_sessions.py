"""capture/proxy/sessions.py: placing calls by conversation, in memory (the proxy's tests are in
tests/integration/test_capture_sessions.py)."""

from __future__ import annotations

from lcap.capture.proxy import sessions
from lcap.capture.proxy.sessions import MAX_CONVERSATION_ITEMS, Sessions


def _chat(n: int) -> dict:
    return {"messages": [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(n)]}


def test_a_conversation_goes_on_in_its_episode():
    placed = Sessions(conversations=True)
    first = placed.by_body("chat", _chat(3), "tenant")
    assert placed.by_body("chat", _chat(5), "tenant") == first
    assert placed.by_body("chat", _chat(5), "another tenant") != first


def test_a_call_of_too_many_messages_is_not_digested_and_starts_an_episode(monkeypatch):
    """A call of 3 million messages once held every other agent's calls 22.9 s while the event loop digested it
    (issue 48 row 4): past MAX_CONVERSATION_ITEMS its messages are not digested at all."""
    placed = Sessions(conversations=True)
    longest = placed.by_body("chat", _chat(MAX_CONVERSATION_ITEMS), "tenant")
    assert longest is not None and placed.too_long == 0

    def refuse(*args: object) -> list[bytes]:
        raise AssertionError("a call over the limit was digested")

    monkeypatch.setattr(sessions, "_prefix_digests", refuse)
    huge = placed.by_body("chat", _chat(MAX_CONVERSATION_ITEMS + 1), "tenant")
    assert huge is not None and huge != longest and placed.too_long == 1
