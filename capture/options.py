"""The capture proxy's options (`lcap proxy`, collect's proxy, `CaptureProxy`): each default and help, written once."""

from __future__ import annotations

from dataclasses import dataclass

from lcap.cli_options import option


@dataclass(frozen=True)
class ProxyOptions:
    """Where the proxy listens and where it sends the LLM calls it captures."""

    upstream: str | None = option(None, help="Send LLM calls to this server instead (URL, or 'policy').")
    model: str | None = option(None, help="Ask the upstream for this model instead of the agent's.")
    token_ids: bool | None = option(
        None,
        flag="--token-ids/--no-token-ids",
        help="Ask vLLM for token ids and logprobs (default: when the upstream is vLLM).",
    )
    host: str = option("127.0.0.1", help="Listen address.")
    port: int = option(0, help="Listen port (0: a free one).")
