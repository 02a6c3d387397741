"""Upstreams that hang, agents that leave: every call ends, with an error turn, its time and its file descriptors.

An upstream that does not connect, does not answer or stops mid-stream is cut off after `--connect-timeout`,
`--first-byte-timeout` or `--stream-idle-timeout` (504 when the agent has had nothing yet). An agent that leaves
while its call runs cancels the call at once: the upstream connection is closed then, the turn says so with the
real latency, and no task is left behind for the garbage collector. Both transports: the front, and mitmproxy
(which gets a call whose body is chunked).
"""

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
