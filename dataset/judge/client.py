"""One judge call to an OpenAI-compatible endpoint, through a capture proxy: each call is stored as an episode.

The endpoint is `--judge-url` and `--judge-model` with a key from the environment, or by default lcap's own
policy server asked for its base model (no adapter: the weights being trained never judge themselves). The call
goes through the judge pass's `CaptureProxy` with the judge episode's credentials, so the store keeps its
request and answer as it keeps an agent's (redacted: the key never reaches disk). The answer is asked for as JSON
under a schema (`response_format` json_schema; on lcap's own vLLM server `structured_outputs` with the same JSON
as a regular expression, vLLM's guided decoding); an endpoint that ignores it is read by the parser all the same. A call that cannot connect, times out or gets a 429 or 5xx is tried again, at most
`--judge-retries` times, each try bounded by `--judge-timeout`. `model_context` reads the model's context where
the endpoint reports it (vLLM's `max_model_len`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from lcap.config import LcapError
from lcap.dataset.options import JudgeOptions
from lcap.policy import read_policy

BACKOFF_S = 1.0  # before the first retry; doubled each time
ERROR_BODY = 300  # characters of an error answer kept in the reason
MODELS_TIMEOUT_S = 10.0  # the most `GET /models` may take (the judge's context), within --judge-timeout


class JudgeCallError(Exception):
    """The judge endpoint gave no answer to read (down, slow, an HTTP error, no choices)."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL of the OpenAI API, ending before /chat/completions
    model: str
    key: str | None = field(default=None, repr=False)
    vllm: bool = False  # lcap's policy server: vLLM's own structured_outputs (a regular expression)


@dataclass(frozen=True)
class Answer:
    content: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    tries: int


def resolve_endpoint(options: JudgeOptions) -> Endpoint:
    """The judge's endpoint from the options, else the running policy server's base model."""
    if options.judge_url is not None:
        if not options.judge_model:
            raise LcapError("--judge-url needs --judge-model (the model the judge endpoint serves)")
        key = os.environ.get(options.judge_key_env) or os.environ.get("OPENAI_API_KEY") or None
        return Endpoint(options.judge_url.rstrip("/"), options.judge_model, key)
    record = read_policy()
    if record is None:
        raise LcapError(
            "--verifier judge: needs a judge: start lcap's policy server (`lcap serve`, its base weights judge) "
            "or give --judge-url and --judge-model"
        )
    return Endpoint(
        record.url.rstrip("/") + "/v1", options.judge_model or record.served_model, record.api_key(), vllm=True
    )


def model_context(endpoint: Endpoint, timeout: float = MODELS_TIMEOUT_S) -> int | None:
    """The judge model's context in tokens where its endpoint says (`max_model_len` in vLLM's `GET /v1/models`),
    else None: an endpoint that does not say, cannot be reached or answers nonsense leaves `--judge-context` alone.
    Asked directly, not through the capture proxy: it judges nothing."""
    headers = {"authorization": f"Bearer {endpoint.key}"} if endpoint.key else {}
    try:
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(timeout)) as client:
            reply = client.get(f"{endpoint.url}/models", headers=headers)
        models = reply.json().get("data") if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    for model in models if isinstance(models, list) else []:
        if isinstance(model, dict) and model.get("id") == endpoint.model:
            length = model.get("max_model_len")
            return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
    return None


class JudgeClient:
    """Calls the judge endpoint through a capture proxy, `proxy_url(episode)` naming the judge episode."""

    def __init__(self, endpoint: Endpoint, options: JudgeOptions) -> None:
        self.endpoint = endpoint
        self.timeout = options.judge_timeout
        self.retries = options.judge_retries
        self.max_tokens = options.judge_max_tokens

    def ask(
        self, messages: list[dict[str, str]], schema: dict[str, Any], regex: str, proxy: str, *, answers: int = 1
    ) -> Answer:
        """The judge's answer to `messages` (JSON under `schema`, or on lcap's vLLM matching `regex`), the call made
        through the proxy URL `proxy`."""
        body = {
            "model": self.endpoint.model,
            "messages": messages,
            "temperature": 0.0,
            "max_tokens": self.max_tokens * answers,
        }
        if self.endpoint.vllm:  # the JSON as a regular expression: a small judge would pad a schema's whitespace
            body["structured_outputs"] = {"regex": regex}
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
        headers = {"authorization": f"Bearer {self.endpoint.key}"} if self.endpoint.key else {}
        started = time.monotonic()
        error = "no try"
        with httpx.Client(proxy=proxy, trust_env=False, timeout=httpx.Timeout(self.timeout)) as client:
            for attempt in range(self.retries + 1):
                if attempt:
                    time.sleep(BACKOFF_S * 2 ** (attempt - 1))
                try:
                    reply = client.post(f"{self.endpoint.url}/chat/completions", json=body, headers=headers)
                except httpx.TimeoutException:
                    error = f"the judge did not answer within {self.timeout:g}s"
                    continue
                except httpx.HTTPError as exc:
                    error = f"cannot reach the judge at {self.endpoint.url}: {exc.__class__.__name__}: {exc}"
                    continue
                if reply.status_code == 429 or reply.status_code >= 500:
                    error = f"the judge answered HTTP {reply.status_code}: {reply.text[:ERROR_BODY]}"
                    continue
                if reply.status_code != 200:  # a request the endpoint refuses is refused again: no retry
                    raise JudgeCallError(f"the judge answered HTTP {reply.status_code}: {reply.text[:ERROR_BODY]}")
                return _answer(reply, time.monotonic() - started, attempt + 1)
        raise JudgeCallError(f"{error} ({self.retries + 1} tries)")


def _answer(reply: httpx.Response, seconds: float, tries: int) -> Answer:
    try:
        data = reply.json()
        message = data["choices"][0]["message"]
        content = message.get("content") or ""
        usage = data.get("usage") or {}
        prompt_tokens, completion_tokens = (
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
        )
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise JudgeCallError(f"the judge's answer is not a chat completion: {reply.text[:ERROR_BODY]!r}") from None
    return Answer(str(content), prompt_tokens, completion_tokens, seconds, tries)
