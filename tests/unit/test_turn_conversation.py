"""A request's conversation read once per dialect (lcap.capture.turns.conversation), for the UI and for the chat
template alike."""

from __future__ import annotations

from lcap.capture.turns.conversation import anthropic_entries, content_blocks, responses_entries
from lcap.dataset.build.rebuild import chat_from_anthropic, chat_from_responses
from lcap.ui.conversation import prompt_messages

RESPONSES = {
    "instructions": "be brief",
    "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "name": "w", "id": "fc1", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "fc1", "output": "sunny"},
    ],
}
ANTHROPIC = {
    "system": [{"type": "text", "text": "s"}],
    "messages": [
        {"role": "user", "content": "list"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "ok"}, {"type": "tool_use", "id": "t", "name": "ls"}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "a"}]}],
        },
    ],
}


def test_entries_of_each_dialect_in_order():
    assert [(e.kind, e.role, e.call_id) for e in responses_entries(RESPONSES)] == [
        ("message", "system", None),
        ("message", "developer", None),
        ("message", "user", None),
        ("reasoning", None, None),
        ("call", None, "fc1"),  # the item's id where it has no call_id
        ("result", None, "fc1"),
    ]
    assert responses_entries(RESPONSES)[3].text == "think"
    assert responses_entries({"input": {"not": "items"}})[0].kind == "other"
    assert [(e.role, [b.kind for b in content_blocks(e.content)]) for e in anthropic_entries(ANTHROPIC)] == [
        ("system", ["text"]),
        ("user", ["text"]),
        ("assistant", ["text", "call"]),
        ("user", ["result"]),
    ]
    assert [b.kind for b in content_blocks([{"type": "image_url"}, {"type": "thinking"}, 3, {"type": "?"}])] == [
        "media",
        "reasoning",
        "other",
        "other",
    ]


def test_the_ui_and_the_chat_template_read_the_same_conversation():
    """The UI's messages and the chat template's are made from the same entries: the same roles, calls and results
    in the same order (the UI shows a reasoning item as a message of its own; the template joins it to the next
    assistant message)."""
    shown = [(m.role, [p.kind for p in m.parts]) for m in prompt_messages("responses", RESPONSES)]
    messages, _ = chat_from_responses(RESPONSES) or ([], None)
    assert shown == [
        ("system", ["text"]),
        ("developer", ["text"]),
        ("user", ["text"]),
        ("assistant", ["reasoning"]),
        ("assistant", ["tool_call"]),
        ("tool", ["tool_result"]),
    ]
    assert [(m["role"], m.get("reasoning_content"), m.get("tool_call_id")) for m in messages] == [
        ("system", None, None),
        ("system", None, None),
        ("user", None, None),
        ("assistant", "think", None),
        ("tool", None, "fc1"),
    ]
    assert messages[3]["tool_calls"][0]["id"] == "fc1"
    shown = [(m.role, [p.kind for p in m.parts]) for m in prompt_messages("messages", ANTHROPIC)]
    messages, _ = chat_from_anthropic(ANTHROPIC)
    assert shown == [
        ("system", ["text"]),
        ("user", ["text"]),
        ("assistant", ["text", "tool_call"]),
        ("tool", ["tool_result"]),
    ]
    assert messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": "ok", "tool_calls": [{"id": "t", "name": "ls", "arguments": {}}]},
        {"role": "tool", "tool_call_id": "t", "content": "a"},
    ]
