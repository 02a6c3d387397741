"""Captured samples as GRPO groups: read `samples.parquet`, drop or keep stale ones, pad groups.

The episode builder writes one row per sample (see `lcap.dataset.build.builder`). GRPO trains on groups
of samples of one task; TRL wants every group to have exactly `num_generations` members, while a
captured group can be short (an episode failed, a stale sample was dropped). Short groups are
padded with copies whose loss mask is all zero and whose advantage is zero: they take a slot in
the batch but move nothing, so each keeps one prompt and one completion token (a full copy would cost a
sample's whole forward and backward for nothing).

Episode weighting (`--sample-weight episode`): an episode weighs the same in the loss whether it is one sample or k.
TRL's token-level losses (dapo, bnpo, dr_grpo, cispo, luspo) sum every loss token of the batch under one
normaliser, and an episode split into k samples has the same completion tokens as when it is one, so it already
weighs the same: the builder's `weight` changes nothing there. The per-sequence losses (grpo, sapo) average each
sample's tokens, then the samples: there each sample's advantage is multiplied by its `weight` (1/k), so the
policy-gradient term of an episode's k samples sums to that of one sample,
    loss = 1/B * sum_s weight_s * mean_t(-min(r_st * A_s, clip(r_st) * A_s)),
exact for any weight >= 0 (min(r A w, clip(r) A w) = w min(r A, clip(r) A)). The KL term (--beta) stays per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from lcap.dataset import read_samples_table

# TRL's losses that average each sequence's tokens before averaging the sequences: an episode split into k samples
# counts k times there unless its samples carry weight 1/k.
PER_SEQUENCE_LOSSES = ("grpo", "sapo")


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
    weight: float = 1.0  # the sample's share of its episode (samples.parquet's `weight`)

    def pad_copy(self) -> Sample:
        return replace(
            self,
            sample_id=f"{self.sample_id}#pad",
            prompt_ids=self.prompt_ids[-1:],
            completion_ids=self.completion_ids[:1],
            logprobs=self.logprobs[:1],
            env_mask=[0] * len(self.completion_ids[:1]),
            advantage=0.0,
            padding=True,
        )


@dataclass
class Groups:
    """Samples grouped for GRPO, in a stable order, each group exactly `size` long."""

    size: int
    groups: dict[str, list[Sample]]
    dropped_stale: int = 0
    dropped_alone: int = 0
    padded: int = 0

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
    return [
        Sample(
            sample_id=r["sample_id"],
            group_id=r["group_id"],
            prompt_ids=r["prompt_ids"],
            completion_ids=r["completion_ids"],
            logprobs=r["logprobs"],
            env_mask=r["env_mask"],
            reward=r["reward"],
            advantage=r["advantage"],
            deployment=r["deployment"],
            truncated=bool(r["truncated"]),
            behaviour=_has_behaviour_logprobs(r),
            weight=1.0 if r["weight"] is None else r["weight"],
        )
        for r in read_samples_table(path).to_pylist()
    ]


def weighted(samples: list[Sample], sample_weight: str, loss_type: str) -> list[Sample]:
    """`samples` with each advantage multiplied by its weight where the loss needs it (see the module docstring)."""
    if sample_weight == "sample" or loss_type not in PER_SEQUENCE_LOSSES:
        return samples
    return [replace(s, advantage=s.advantage * s.weight) for s in samples]


def make_groups(
    samples: list[Sample],
    *,
    group_size: int | None = None,
    stale: str = "correct",
    current: str | None = None,
    min_group: int = 2,
) -> Groups:
    """Group samples by `group_id`; with `stale="drop"` keep only those served by `current`.

    `group_size` defaults to the largest group. Groups with fewer than `min_group` real samples
    carry no GRPO signal and are dropped; a longer group is cut to `group_size`.
    """
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
    dropped_alone = padded = 0
    for gid, members in by_group.items():
        if len(members) < min_group:
            dropped_alone += len(members)
            continue
        members = members[:size]
        while len(members) < size:
            members.append(members[len(members) % len(members)].pad_copy())
            padded += 1
        groups[gid] = members
    return Groups(size=size, groups=groups, dropped_stale=dropped_stale, dropped_alone=dropped_alone, padded=padded)


def _has_behaviour_logprobs(row: dict) -> bool:
    """Whether a sample's logprobs came from the policy that served it (see `Sample.behaviour`)."""
    if row.get("rebuilt"):
        return False
    return any(lp != 0.0 for lp, m in zip(row["logprobs"], row["env_mask"]) if m)


@dataclass(frozen=True)
class TokenCount:
    """What a round's samples give the loss: trainable tokens, and the samples that give none, by cause."""

    trainable: int  # completion tokens with loss mask 1 in samples with a nonzero advantage
    samples: int
    truncated: int  # samples cut by the token limit whose every completion token is masked (--truncated mask)
    masked: int  # other samples whose every completion token is masked
    zero_variance: int  # samples with advantage 0: their group's rewards were all equal (--keep-zero-variance)


def count_tokens(samples: list[Sample]) -> TokenCount:
    """Count the trainable tokens of `samples` (padding copies excluded) and the samples that add none."""
    trainable = truncated = masked = zero = 0
    real = [s for s in samples if not s.padding]
    for s in real:
        tokens = sum(1 for m in s.env_mask if m)
        if not tokens:
            if s.truncated:
                truncated += 1
            else:
                masked += 1
        elif s.advantage == 0:
            zero += 1
        else:
            trainable += tokens
    return TokenCount(trainable=trainable, samples=len(real), truncated=truncated, masked=masked, zero_variance=zero)
