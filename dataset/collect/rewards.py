"""Rewards: one row per verdict in the `rewards` table; the latest per episode wins (view latest_rewards)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from lcap.config import LcapError
from lcap.store import Store


def add_reward(
    store: Store,
    episode_id: str,
    value: float,
    *,
    details: str | Mapping[str, Any] | None = None,
    source: str = "cli",
    key: str | None = None,
) -> bool:
    """Record a reward for an existing episode; rewards may arrive long after the episode ended. With `key`, a
    reward that key already stored is not stored again (returns False)."""
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
    return store.add_reward(episode_id, float(value), details=json.dumps(details or {}), source=source, key=key)
