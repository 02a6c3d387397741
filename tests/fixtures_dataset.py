"""Fixtures of the dataset tests: real DuckDB stores filled the way capture and collect fill them."""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

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
        if reward is not None:
            self.reward(episode_id, reward)
        for flag in flags:
            self.store.append(
                "episode_flags", [{"episode_id": episode_id, "flag": flag, "details": "{}", "created_at": self._tick()}]
            )
        return episode_id

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
