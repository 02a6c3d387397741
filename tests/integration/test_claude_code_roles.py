"""Issue #52: a real Claude Code run that starts a sub-agent, captured by `lcap proxy --role-by thread`, stores the
main thread's calls as role `main` and the sub-agent's as `subagent`, all of one episode.

The upstream is scripted (FakeLLM's `script`, Anthropic Messages, streamed), because the tiny random policy cannot
decide to call a tool on purpose: the main thread's first call is answered with a tool_use of Claude Code's
sub-agent tool (`Agent`, its input as the installed package's sdk-tools.d.ts `AgentInput` declares it), every other
call with end_turn text. Claude Code itself is the real binary at scripts/harnesses/versions, started by
scripts/harnesses/claude.sh as a user would, its calls to api.anthropic.com rerouted by the proxy. It needs the
installed harness (npm installs it): the installer runs first (idempotent), and a harness it cannot install fails
this test with the installer's message, never skips it.

Claude Code opens every call's system prompt with a block that names the call (`x-anthropic-billing-header: ...;
cch=HASH; ...`); before capture/turns/dialects.py left it out of a conversation's key, every main-thread call after
the first was stored as `subagent`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from fixtures_capture import FakeLLM, run_lcap, turns

REPO = Path(__file__).resolve().parents[2]
HARNESSES = REPO / "scripts" / "harnesses"
MAIN_TASK = "MAIN-TASK: start one sub-agent, then stop."
SUB_TASK = "SUB-TASK: answer done."
SUBAGENT_TOOL = "Agent"  # Claude Code's sub-agent tool (named Task before 2.x)


def _first_text(request: dict) -> str:
    messages = request.get("messages") or [{}]
    return json.dumps(messages[0].get("content"))


def _script(request: dict) -> dict | None:
    """The main thread's first call: start a sub-agent; everything else (the sub-agent, the main thread once the
    tool's result is in): text, end_turn."""
    tools = {t.get("name") for t in request.get("tools") or []}
    last = json.dumps((request.get("messages") or [{}])[-1])
    if MAIN_TASK in _first_text(request) and "tool_result" not in last and SUBAGENT_TOOL in tools:
        arguments = {"description": "Answer done", "prompt": SUB_TASK, "subagent_type": "general-purpose"}
        return {"name": SUBAGENT_TOOL, "arguments": arguments}
    return None


@pytest.fixture
def claude_code() -> Path:
    """The harness directory with Claude Code installed (scripts/harnesses/install.sh claude)."""
    directory = Path(os.environ.get("LCAP_HARNESS_DIR") or Path.home() / ".cache" / "lcap-harnesses")
    done = subprocess.run(
        [str(HARNESSES / "install.sh"), "claude"],
        env=dict(os.environ, LCAP_HARNESS_DIR=str(directory)),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if done.returncode != 0:
        pytest.fail(f"Claude Code is not installed: {done.stderr.strip()[-1500:] or done.returncode}")
    return directory


def test_a_claude_code_sub_agents_calls_are_its_thread_role(capture_env, claude_code):
    llm = FakeLLM()
    llm.thread.start()
    llm.script = _script
    try:
        env = {**capture_env, "LCAP_HARNESS_DIR": str(claude_code), "LCAP_MAX_TURNS": "3"}
        result = run_lcap(
            ["proxy", "--upstream", llm.url, "--role-by", "thread", "--", str(HARNESSES / "claude.sh"), MAIN_TASK],
            env,
            timeout=300,
        )
    finally:
        llm.shutdown()
        llm.server_close()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    calls = llm.calls("/messages")
    started = [c for c in calls if any(b.get("name") == SUBAGENT_TOOL for b in _tool_uses(c["body"]))]
    assert started, "Claude Code never sent the sub-agent's tool_use back: the script did not start one"

    rows = turns(capture_env["LCAP_DB"])
    assert len(rows) == len(calls) >= 3, (len(rows), len(calls))
    by_thread = {(SUB_TASK in _first_text(row["request"]), row["role"], row["episode_id"]) for row in rows}
    episode = rows[0]["episode_id"]
    assert by_thread == {(False, "main", episode), (True, "subagent", episode)}, by_thread


def _tool_uses(request: dict) -> list[dict]:
    """The tool_use blocks of the assistant messages a request carries (what the agent was answered before)."""
    return [
        block
        for message in request.get("messages") or []
        if message.get("role") == "assistant" and isinstance(message.get("content"), list)
        for block in message["content"]
        if isinstance(block, dict) and block.get("type") == "tool_use"
    ]
