"""A call's role (capture/proxy/roles.py): the header, else the first --role-by rule that matches, else default."""

from __future__ import annotations

import pytest

from lcap.capture.proxy.roles import EpisodeThreads, parse_role_by, role_of, system_prompt, take_role_header
from lcap.capture.turns.dialects import thread_key
from lcap.config import LcapError

RULES = parse_role_by(["model:gpt-4o-mini=router", "system:(?i)you plan=planner", "model:x:y=a=b"])


def test_the_header_wins_then_the_first_rule_that_matches_then_default():
    planner = {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "You plan the work"}]}
    assert role_of("coder", RULES, planner) == "coder"
    assert role_of(None, RULES, planner) == "router"  # the first matching rule, in the order given
    assert role_of(None, RULES, {**planner, "model": "other"}) == "planner"
    assert role_of(None, RULES, {"model": "other", "messages": []}) == "default"
    assert role_of(None, RULES, "not json") == "default"
    assert role_of(None, RULES, {"model": "x:y=a"}) == "b"  # the role is after the last '='


@pytest.mark.parametrize(
    "request_body",
    [
        {"system": "You plan."},  # Anthropic Messages
        {"system": [{"type": "text", "text": "You plan."}]},
        {"instructions": "You plan."},  # Responses
        {"input": [{"role": "developer", "content": [{"type": "input_text", "text": "You plan."}]}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "You plan."}]},
    ],
)
def test_a_system_rule_reads_the_system_prompt_of_every_dialect(request_body):
    assert "You plan." in system_prompt(request_body)
    assert role_of(None, RULES, request_body) == "planner"


@pytest.mark.parametrize(
    ("rule", "why"),
    [
        ("planner", "use model:NAME=ROLE"),
        ("thread:x=y", "use model:NAME=ROLE, system:REGEX=ROLE or thread"),
        ("model:=planner", "use model:NAME=ROLE"),
        ("model:m=", "a role is"),
        ("model:m=two words", "a role is"),
        ("system:(unclosed=planner", "missing"),
    ],
)
def test_a_rule_lcap_cannot_read_is_refused_in_one_line(rule, why):
    with pytest.raises(LcapError, match=why):
        parse_role_by([rule])


def test_the_role_header_is_taken_out_whatever_its_case_and_a_bad_value_names_no_role():
    fields = ((b"Host", b"api"), (b"X-LCAP-Role", b" coder "), (b"Accept", b"*/*"))
    assert take_role_header(fields) == ("coder", ((b"Host", b"api"), (b"Accept", b"*/*")))
    assert take_role_header(((b"x-lcap-role", b"../etc"),)) == (None, ())
    plain = ((b"Host", b"api"),)
    assert take_role_header(plain)[1] is plain


def test_by_thread_an_episodes_first_conversation_is_main_and_the_others_subagents():
    """`--role-by thread`: a sub-agent opens a conversation of its own (its system prompt and first message); the
    main agent's later calls, which extend its first conversation, stay `main`; another episode has its own first."""
    rules = parse_role_by(["model:haiku=side", "thread"])
    threads = EpisodeThreads()

    def role(episode: str, request: dict) -> str:
        return role_of(None, rules, request, lambda: threads.is_first(episode, thread_key("chat", request)[0]))

    main = [{"role": "system", "content": "You are the lead."}, {"role": "user", "content": "fix the bug"}]
    sub = [{"role": "system", "content": "You search files."}, {"role": "user", "content": "find foo"}]
    assert role("e1", {"model": "m", "messages": main}) == "main"
    assert role("e1", {"model": "m", "messages": sub}) == "subagent"
    assert role("e1", {"model": "m", "messages": [*main, {"role": "assistant", "content": "ok"}]}) == "main"
    assert role("e1", {"model": "haiku", "messages": sub}) == "side"  # an earlier rule wins
    assert role("e2", {"model": "m", "messages": sub}) == "main"  # each episode's own first conversation
    threads.forget("e1")
    assert role("e1", {"model": "m", "messages": sub}) == "main"


def test_episode_threads_are_bounded():
    threads = EpisodeThreads(limit=2)
    for episode in ("a", "b", "c"):
        assert threads.is_first(episode, 1)
    assert threads.is_first("a", 2)  # forgotten: its next call opens its first thread again


def test_claude_codes_per_call_system_block_does_not_make_each_call_a_conversation():
    """Claude Code opens every call's system prompt with a block naming the call (`x-anthropic-billing-header:
    ...; cch=HASH; cc_turn_index=N;`): the main thread's calls are still one conversation, its sub-agent (another
    system prompt) another. Without the fix every main-thread call after the first was a `subagent`."""

    def call(billing: str, prompt: str, first: str, more: int = 0) -> dict:
        system = [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={billing}; cc_turn_index=1;"},
            {"type": "text", "text": prompt, **({"cache_control": {"type": "ephemeral"}} if more else {})},
        ]
        messages = [{"role": "user", "content": [{"type": "text", "text": first}]}]
        return {"system": system, "messages": messages + [{"role": "assistant", "content": "ok"}] * more}

    first = thread_key("messages", call("048d0", "You are the lead.", "fix the bug"))
    later = thread_key("messages", call("9d246", "You are the lead.", "fix the bug", more=2))
    sub = thread_key("messages", call("3e584", "You search files.", "find foo"))
    assert first[0] == later[0] and (first[1], later[1]) == (1, 3)
    assert sub[0] != first[0]
    assert thread_key("messages", {"system": "plain", "messages": []})[0] != first[0]  # a string system: as it is
