"""Rewards: one row per verdict in the `rewards` table; the latest per episode wins (view latest_rewards)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from lcap.config import LcapError
from lcap.store import Store, now


def add_reward(
    store: Store, episode_id: str, value: float, *, details: str | Mapping[str, Any] | None = None, source: str = "cli"
) -> None:
    """Record a reward for an existing episode; rewards may arrive long after the episode ended."""
    if not math.isfinite(value):
        raise LcapError(f"reward must be a finite number, not {value}")
    if isinstance(details, str):
        try:
            parsed = json.loads(details)
        except json.JSONDecodeError as exc:
            raise LcapError(f"--details is not JSON: {exc.msg}") from None
        if not isinstance(parsed, dict):
            raise LcapError("--details must be a JSON object")
        details = parsed
    if not store.fetchall("SELECT 1 FROM episodes WHERE episode_id = ?", [episode_id]):
        raise LcapError(f"no episode {episode_id!r} in {store.path}")
    store.append(
        "rewards",
        [
            {
                "episode_id": episode_id,
                "value": float(value),
                "details": json.dumps(details or {}),
                "source": source,
                "created_at": now(),
            }
        ],
    )
