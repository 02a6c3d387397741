"""Why `Calls` refuses a call, as both transports (the front, mitmproxy's addon) answer the agent: each exception
names its status, and the turn is stored with its message."""

from __future__ import annotations


class Unauthorized(Exception):
    """Credentials are required and the request proves no episode: the agent gets a 407."""


class NoRoute(Exception):
    """`--upstream` is set but has no server to send to right now (no policy record): the agent gets a 503,
    never the original host."""


UNASKED_SWITCH = "the upstream switched protocols (101) on a call that asked for none"  # both transports' 502


class BodyRefused(Exception):
    """An LLM call whose body lcap cannot read as the upstream would (JSON nested past Python's parser): the agent
    gets `status` with this message, and the turn is stored with it and the raw body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AnswerRefused(Exception):
    """An answer lcap must rewrite (the policy route, `--token-ids`) but cannot decode within `--max-body-bytes`: the
    agent gets a 502 with this message, and the turn is stored with it and the answer as it came."""


class HoldRefused(Exception):
    """A call held while every policy replica restarts that no replica took within `--hold-timeout`, or one past
    `--max-held-calls`: the agent gets a 503 with this message, and the turn is stored with it."""
