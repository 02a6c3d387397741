"""Agents that keep calling the policy through a capture proxy, for the deploy and replica tests (not a fixture
plugin: importing the proxy costs every run that loads the plugins seconds)."""

from __future__ import annotations

import itertools
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import APIError, OpenAI

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.store import Store

MESSAGES = [{"role": "user", "content": "Count from one to ten, please."}]


@dataclass
class Agents:
    """Agents that keep running episodes (two calls each) through the proxy until stopped; every call is kept."""

    proxy: CaptureProxy
    threads: int = 4
    stream_every: int = 0  # every Nth episode streams (0: none)
    max_tokens: int = 8
    pause: float = 0.0  # seconds each agent waits between its episodes: traffic that leaves a restarting server the CPU
    calls: list[dict] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Agents:
        for worker in range(self.threads):
            thread = threading.Thread(target=self._run, args=(worker,), daemon=True)
            thread.start()
            self._workers.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self._workers:
            thread.join(300)

    def wait_for(self, n: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        start = len(self.calls)
        while len(self.calls) < start + n:
            assert time.monotonic() < deadline, f"only {len(self.calls) - start} calls in {timeout}s"
            time.sleep(0.1)

    def wait_after(self, since: float, n: int = 4, timeout: float = 300) -> None:
        """Until `n` calls that started after `since` (time.monotonic) have ended: a count of calls alone may be
        reached by fast calls that all started before it."""
        deadline = time.monotonic() + timeout
        while sum(c["started"] > since for c in list(self.calls)) < n:
            assert time.monotonic() < deadline, f"fewer than {n} calls started after the mark in {timeout}s"
            time.sleep(0.1)

    def _run(self, worker: int) -> None:
        episode_number = 0
        while not self.stop.is_set():
            episode = f"w{worker}-e{episode_number}"
            stream = bool(self.stream_every) and episode_number % self.stream_every == 0
            env = self.proxy.child_env(episode, base={})
            verify = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
            with httpx.Client(proxy=env["HTTPS_PROXY"], verify=verify, timeout=300) as http:
                client = OpenAI(api_key="sk-test", http_client=http, max_retries=0)
                for seq in range(2):
                    started = time.monotonic()
                    outcome: dict = {"episode": episode, "seq": seq, "stream": stream, "started": started}
                    try:
                        kwargs = {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": self.max_tokens}
                        if stream:
                            chunks = list(client.chat.completions.create(stream=True, **kwargs))
                            outcome["model"] = chunks[0].model
                        else:
                            outcome["model"] = client.chat.completions.create(**kwargs).model
                        outcome["ok"] = True
                    except (APIError, httpx.HTTPError) as exc:  # a cut stream is httpx's error, not the SDK's
                        outcome.update(ok=False, error=f"{exc.__class__.__name__}: {exc}")
                    outcome["ended"] = time.monotonic()
                    self.calls.append(outcome)
            episode_number += 1
            self.stop.wait(self.pause)


def policy_proxy(tmp_path: Path) -> CaptureProxy:
    """A capture proxy routed to the policy record, over a fresh store under TMP_PATH."""
    return CaptureProxy(Store(tmp_path / "lcap.duckdb"), ProxyOptions(upstream="policy"))


def sdk_clients(proxy: CaptureProxy, episode: str):
    """The OpenAI and Anthropic SDK clients of one episode, through `proxy`."""
    import anthropic
    import openai

    env = proxy.child_env(episode, base={})
    http = httpx.Client(
        proxy=env["HTTPS_PROXY"], verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"]), timeout=300
    )
    return (
        openai.OpenAI(api_key="sk-test", http_client=http, max_retries=0),
        anthropic.Anthropic(api_key="sk-ant-test", http_client=http, max_retries=0),
    )


def episode_samples(db: Path) -> dict[str, int]:
    """Samples per episode under build-dataset's merge (lcap.dataset.build.merge), every turn as captured."""
    import duckdb

    from lcap.dataset.build.merge import merge_turns

    con = duckdb.connect(str(db), read_only=True)
    try:
        table = con.sql(
            "SELECT episode_id, episode_id AS group_id, seq, thread, deployment, rebuilt, truncated,"
            " prompt_ids::INTEGER[] AS prompt_ids, completion_ids::INTEGER[] AS completion_ids,"
            " list_transform(completion_ids, lambda x: 0.0)::FLOAT[] AS logprobs"
            " FROM turn_tokens WHERE prompt_ids IS NOT NULL AND completion_ids IS NOT NULL"
        ).to_arrow_table()
    finally:
        con.close()
    samples = merge_turns(table).column("episode_id").to_pylist()
    return {episode: samples.count(episode) for episode in dict.fromkeys(samples)}


def extends_previous(rows: list[dict]) -> list[bool]:
    """Per call after the first: its prompt ids start with the previous call's prompt + completion ids."""
    out = []
    for before, after in itertools.pairwise(rows):
        seen = before["prompt_token_ids"] + before["completion_token_ids"]
        out.append(after["prompt_token_ids"][: len(seen)] == seen)
    return out
