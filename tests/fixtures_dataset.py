"""Fixtures of the dataset tests: real DuckDB stores filled the way capture and collect fill them."""

from __future__ import annotations

import json
import os
import sys
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lcap.dataset.collect.verifiers import VerifierContext

REPO = Path(__file__).resolve().parents[1]
DATASET_AGENTS = REPO / "scripts" / "agents"
DATASET_VERIFIERS = REPO / "scripts" / "verifiers"
_T0 = datetime(2026, 1, 1, tzinfo=UTC)


class StoreBuilder:
    """Writes episodes, turns and rewards through `Store.append`, as collect and the proxy do."""

    def __init__(self, store) -> None:
        self.store = store
        self.clock = 0

    def _tick(self) -> datetime:
        self.clock += 1
        return _T0 + timedelta(seconds=self.clock)

    def episode(
        self,
        episode_id: str,
        *,
        task: str = "t0",
        sample: int = 0,
        round: int = 1,
        split: str = "train",
        status: str = "ok",
        reward: float | None = None,
        turns: list[dict] = (),
        flags: list[str] = (),
    ) -> str:
        labels = {"task": task, "round": str(round), "sample": str(sample), "split": split}
        self.store.append(
            "episodes",
            [
                {
                    "episode_id": episode_id,
                    "command": "python agent.py",
                    "status": status,
                    "labels": json.dumps(labels),
                    "task_id": task,
                    "round": round,
                    "sample": sample,
                    "split": split,
                    "started_at": self._tick(),
                    "ended_at": self._tick(),
                }
            ],
        )
        self.turns(episode_id, turns)
        if reward is not None:
            self.reward(episode_id, reward)
        for flag in flags:
            self.store.append(
                "episode_flags", [{"episode_id": episode_id, "flag": flag, "details": "{}", "created_at": self._tick()}]
            )
        return episode_id

    def session(self, episode_id: str, *, reward: float | None = None, turns: list[dict] = ()) -> str:
        """An episode a serving proxy opened for live traffic (sessions.py's row): no task, no round, still running."""
        labels = {"session": episode_id, "tenant": "t" * 32, "attributed_by": "header"}
        self.store.append(
            "episodes",
            [{"episode_id": episode_id, "started_at": self._tick(), "status": "running", "labels": json.dumps(labels)}],
        )
        self.turns(episode_id, turns)
        if reward is not None:
            self.reward(episode_id, reward)
        return episode_id

    def turns(self, episode_id: str, turns: list[dict]) -> None:
        rows = []
        for seq, turn in enumerate(turns):
            row = {
                "turn_id": f"{episode_id}/{seq}",
                "episode_id": episode_id,
                "seq": seq,
                "dialect": "chat",
                "status_code": 200,
                "deployment": "tiny",
                "finish_reason": "stop",
                "token_source": "vllm",
                "started_at": self._tick(),
                "ended_at": self._tick(),
            }
            row.update(turn)
            if row.get("completion_token_ids") is not None and "completion_logprobs" not in turn:
                row["completion_logprobs"] = [-0.25] * len(row["completion_token_ids"])
            rows.append(row)
        self.store.append("turns", rows)

    def reward(self, episode_id: str, value: float, source: str = "test", details: dict | None = None) -> None:
        row = {"episode_id": episode_id, "value": value, "details": json.dumps(details or {}), "source": source}
        self.store.append("rewards", [{**row, "created_at": self._tick()}])


def chat_turns(*completions: list[int], system: list[int] = (1, 2, 3), env: list[int] = (90, 91)) -> list[dict]:
    """Turns of one conversation whose prompts extend each other: P(k+1) = P(k) + C(k) + env."""
    prompt = list(system)
    out = []
    for completion in completions:
        out.append({"prompt_token_ids": list(prompt), "completion_token_ids": list(completion)})
        prompt = prompt + list(completion) + list(env)
    return out


@pytest.fixture
def dstore(tmp_path):
    from lcap.store import Store

    return Store(tmp_path / "lcap.duckdb")


@pytest.fixture
def builder(dstore) -> StoreBuilder:
    return StoreBuilder(dstore)


@pytest.fixture
def openai_env(monkeypatch):
    """What an agent's user has in the environment: an API key (the proxy strips it upstream)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-dataset-test-key")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    return os.environ


def py_agent(name: str) -> list[str]:
    return [sys.executable, str(DATASET_AGENTS / name)]


def verifier_context(tmp_path: Path, stdout: str = "", task: dict | None = None) -> VerifierContext:
    """What a verifier is handed for one finished episode (its workdir made under TMP_PATH)."""
    work = tmp_path / "ep" / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work.parent / "stdout.txt").write_text(stdout)
    return VerifierContext(
        task=task or {"id": "t1", "answer": "Paris"},
        episode_id="ep-1",
        workdir=work,
        stdout=stdout,
        exit_code=0,
        status="ok",
    )


def lost_samples_scenario(builder, name: str) -> dict:
    """A round that loses its samples one way; returns the build options that round is built with."""
    if name == "no_episodes":
        builder.episode("other-round", round=2, reward=1.0, turns=chat_turns([5, 2]))
    elif name == "not_finished":
        builder.episode("a", sample=0, status="failed", turns=chat_turns([5, 2]))
        builder.episode("b", sample=1, status="timeout", turns=chat_turns([5, 2]))
        builder.episode("c", sample=2, status="running", turns=chat_turns([5, 2]))
    elif name == "no_reward":
        builder.episode("a", sample=0, turns=chat_turns([5, 2]))
        builder.episode("b", sample=1, turns=chat_turns([6, 2]))
    elif name == "no_calls":
        builder.episode("a", sample=0, reward=1.0)
        builder.episode("b", sample=1, reward=0.0)
    elif name == "failed_calls":
        for i, reward in enumerate((1.0, 0.0)):
            turns = chat_turns([5, 2])
            turns[0].update(status_code=500, error="upstream said no")
            builder.episode(f"e{i}", sample=i, reward=reward, turns=turns)
    elif name == "equal_rewards":
        builder.episode("a", sample=0, reward=0.5, turns=chat_turns([5, 2]))
        builder.episode("b", sample=1, reward=0.5, turns=chat_turns([6, 2]))
    elif name == "singleton":
        builder.episode("a", task="t1", sample=0, reward=1.0, turns=chat_turns([5, 2]))
        builder.episode("b", task="t2", sample=0, reward=0.0, turns=chat_turns([6, 2]))
    elif name == "tampered":
        builder.episode("a", sample=0, reward=0.0, turns=chat_turns([5, 2]), flags=["tampered"])
        builder.episode("b", sample=1, reward=0.0, turns=chat_turns([6, 2]), flags=["tampered"])
        return {"drop_tampered": True, "keep_zero_variance": True}
    return {}


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def policy_stand_in():
    """Something that answers HTTP where the policy server would (collect checks that its upstream is reachable),
    for agents that never call it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
