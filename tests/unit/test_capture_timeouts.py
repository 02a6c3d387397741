"""The agent reader tells when the agent left (hanging upstreams and leaving agents on a running proxy:
tests/integration/test_capture_timeouts.py)."""

from __future__ import annotations

import asyncio

from lcap.capture.proxy.connections import AgentReader


def test_the_agent_reader_says_when_the_agent_left():
    """What cancels a call: the agent's side ending while it runs, or before it started."""

    async def main() -> list[str]:
        reader = AgentReader(loop=asyncio.get_running_loop())
        seen: list[str] = []
        reader.notify(lambda: seen.append("while waiting"))
        reader.feed_eof()
        reader.notify(lambda: seen.append("already gone"))
        reader.notify(None)
        return seen

    assert asyncio.run(main()) == ["while waiting", "already gone"]
