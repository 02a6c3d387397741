"""Captured samples as GRPO groups: read `samples.parquet`, drop or keep stale ones, pad groups.

The episode builder writes one row per sample (see `lcap.dataset.build`). GRPO trains on groups
of samples of one task; TRL wants every group to have exactly `num_generations` members, while a
captured group can be short (an episode failed, a stale sample was dropped). Short groups are
padded with copies whose loss mask is all zero and whose advantage is zero: they take a slot in
the batch but move nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

SAMPLE_COLUMNS = (
    "sample_id", "episode_id", "task_id", "round", "group_id", "prompt_ids", "completion_ids",
    "logprobs", "env_mask", "reward", "advantage", "deployment", "rebuilt", "truncated",
)


@dataclass
class Sample:
    sample_id: str
    group_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    reward: float
    advantage: float
    deployment: str | None = None
    truncated: bool = False
    padding: bool = False  # a zero-weight copy that fills a short group
    # False when the builder had no behaviour logprobs (re-tokenised turns, Responses turns): it
    # writes 0.0 there, which is no logprob of the serving policy, so the IS correction skips it.
    behaviour: bool = True

    def pad_copy(self) -> "Sample":
        return Sample(
            sample_id=f"{self.sample_id}#pad", group_id=self.group_id, prompt_ids=self.prompt_ids,
            completion_ids=self.completion_ids, logprobs=self.logprobs, env_mask=[0] * len(self.env_mask),
            reward=self.reward, advantage=0.0, deployment=self.deployment, truncated=self.truncated, padding=True,
            behaviour=self.behaviour,
        )


@dataclass
class Groups:
    """Samples grouped for GRPO, in a stable order, each group exactly `size` long."""

    size: int
    groups: dict[str, list[Sample]]
    dropped_stale: int = 0
    dropped_small: int = 0
    padded: int = 0
    deployments: Counter = field(default_factory=Counter)

    @property
    def samples(self) -> list[Sample]:
        return [s for members in self.groups.values() for s in members]

    @property
    def real_samples(self) -> list[Sample]:
        return [s for s in self.samples if not s.padding]

    def pad_to_multiple(self, n: int) -> int:
        """Add zero-weight copies of groups until the count is a multiple of `n`; returns how many."""
        real = list(self.groups.items())
        added = 0
        while len(self.groups) % n:
            gid, members = real[added % len(real)]
            self.groups[f"{gid}#pad{added}"] = [s.pad_copy() for s in members]
            added += 1
        self.padded += added * self.size
        return added

    def mean_reward(self) -> float:
        real = self.real_samples
        return sum(s.reward for s in real) / len(real) if real else float("nan")


def read_samples(path: str | Path) -> list[Sample]:
    """Read the episode builder's `samples.parquet` (a file, or the folder that holds it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "samples.parquet"
    table = pq.read_table(path)
    missing = {"group_id", "prompt_ids", "completion_ids", "logprobs", "env_mask", "reward", "advantage"} - set(table.column_names)
    if missing:
        from lcap.config import LcapError

        raise LcapError(f"{path} is not a samples file: missing columns {', '.join(sorted(missing))}")
    rows = table.to_pylist()
    return [
        Sample(
            sample_id=str(r.get("sample_id") or i), group_id=str(r["group_id"]), prompt_ids=list(r["prompt_ids"]),
            completion_ids=list(r["completion_ids"]), logprobs=[float(x) for x in r["logprobs"]],
            env_mask=[int(x) for x in r["env_mask"]], reward=float(r["reward"]), advantage=float(r["advantage"]),
            deployment=r.get("deployment"), truncated=bool(r.get("truncated") or False),
            behaviour=_has_behaviour_logprobs(r),
        )
        for i, r in enumerate(rows)
    ]


def make_groups(
    samples: list[Sample], *, group_size: int | None = None, stale: str = "correct", current: str | None = None,
    min_group: int = 2,
) -> Groups:
    """Group samples by `group_id`; with `stale="drop"` keep only those served by `current`.

    `group_size` defaults to the largest group. Groups with fewer than `min_group` real samples
    carry no GRPO signal and are dropped; a longer group is cut to `group_size`.
    """
    if stale not in ("correct", "drop"):
        from lcap.config import LcapError

        raise LcapError(f"unknown --stale {stale!r}: use correct or drop")
    dropped_stale = 0
    if stale == "drop" and current is not None:
        kept = [s for s in samples if s.deployment == current]
        dropped_stale = len(samples) - len(kept)
        samples = kept
    by_group: dict[str, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    size = group_size or max((len(m) for m in by_group.values()), default=0)
    groups: dict[str, list[Sample]] = {}
    dropped_small = padded = 0
    for gid, members in by_group.items():
        if len(members) < min_group:
            dropped_small += len(members)
            continue
        members = members[:size]
        while len(members) < size:
            members.append(members[len(members) % len(members)].pad_copy())
            padded += 1
        groups[gid] = members
    return Groups(
        size=size, groups=groups, dropped_stale=dropped_stale, dropped_small=dropped_small, padded=padded,
        deployments=Counter(s.deployment for s in samples),
    )


def _has_behaviour_logprobs(row: dict) -> bool:
    """Whether a sample's logprobs came from the policy that served it (see `Sample.behaviour`)."""
    if row.get("rebuilt"):
        return False
    return any(lp != 0.0 for lp, m in zip(row["logprobs"], row["env_mask"]) if m)
