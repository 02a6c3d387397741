"""The screen `lcap collect` ends with: every episode of the collect (this run's and earlier runs'), read back
from the store: by status, the most common failure reasons with one stderr.txt to open for each, turns captured
per episode (and what zero means), rewards."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lcap.dataset.build.explain import NO_CALLS_FIX, NO_CALLS_FIX_TRANSPARENT, plural
from lcap.dataset.collect.verifiers import VERIFIER_OUTPUT
from lcap.display import num
from lcap.store import Store

REASONS = 3  # failure reasons shown, the most common first
REASON_CHARS = 160

_TOTALS = """
WITH e AS (SELECT * FROM episode_summary WHERE episode_id IN (SELECT unnest($ids)))
SELECT count(*), min(n_turns), median(n_turns), max(n_turns),
       count(*) FILTER (WHERE n_turns = 0), count(*) FILTER (WHERE n_turns = 0 AND status = 'ok'),
       avg(reward), count(reward),
       count(*) FILTER (WHERE list_contains(flags, 'tampered')),
       count(*) FILTER (WHERE list_contains(flags, 'turns_unstored'))
FROM e
"""
_STATUSES = """
SELECT coalesce(status, 'unknown'), count(*) FROM episodes WHERE episode_id IN (SELECT unnest($ids))
GROUP BY ALL ORDER BY count(*) DESC, 1
"""
# Reasons told apart by their words, not their numbers (exit codes, seconds, line numbers) nor the task fields they
# quote (an agent's usage error naming its --word): a field's value reads `{field}`. One example each.
_REASONS = f"""
WITH f AS (SELECT unnest($ids) AS episode_id, unnest($fields::STRUCT(name VARCHAR, value VARCHAR)[][]) AS fields),
     r AS (SELECT e.episode_id,
                  list_reduce(f.fields, lambda text, field: replace(text, field.value, '{{' || field.name || '}}'),
                              coalesce(e.error, e.status)) AS text
           FROM episodes e JOIN f USING (episode_id) WHERE e.status <> 'ok')
SELECT regexp_replace(text, '[0-9]+', 'N', 'g') AS kind, count(*) AS n, min(episode_id) AS example,
       arg_min(text, episode_id) AS text
FROM r GROUP BY kind ORDER BY n DESC, example LIMIT {REASONS}
"""
MIN_FIELD_CHARS = 3  # shorter task values ("a", "12") are left in a reason: they would match words of every reason


@dataclass
class Reason:
    count: int
    text: str  # the example episode's error
    example: Path  # its stderr.txt, or its verifier.txt for a verifier's error


@dataclass
class CollectSummary:
    episodes: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    reasons: list[Reason] = field(default_factory=list)
    other_failures: int = 0  # failures of reasons not shown
    turns_min: int = 0
    turns_median: float = 0.0
    turns_max: int = 0
    no_turns: int = 0
    no_turns_ok: int = 0
    mean_reward: float | None = None
    rewarded: int = 0
    tampered: int = 0
    unstored: int = 0
    transparent: bool = False  # collected with --transparent: the hint for episodes without turns differs

    def lines(self) -> list[str]:
        out = ["  episodes: " + (", ".join(f"{s} {n}" for s, n in self.statuses.items()) or "none")]
        reward = (
            f"mean {num(self.mean_reward)} over {self.rewarded} rewarded episodes" if self.rewarded else "none given"
        )
        if self.tampered:
            reward += f" ({self.tampered} tampered: reward 0)"
        out.append(f"  reward: {reward}")
        if self.episodes:
            out.append(f"  turns per episode: min {self.turns_min}, median {self.turns_median:g}, max {self.turns_max}")
        if self.no_turns and not self.no_turns_ok and self.reasons:
            out.append(
                f"  {plural(self.no_turns, 'episode')} with 0 turns, none finished ok: the "
                "agent ended before any LLM call through lcap: see the failures below"
            )
        elif self.no_turns:
            some = f" ({self.no_turns_ok} of them finished ok)" if self.no_turns_ok else ""
            out.append(
                f"  {plural(self.no_turns, 'episode')} with 0 turns{some}: "
                f"the agent made no LLM call through lcap: "
                f"{NO_CALLS_FIX_TRANSPARENT if self.transparent else NO_CALLS_FIX}"
            )
        if self.unstored:
            out.append(
                f"  {self.unstored} episodes flagged turns_unstored: the next lcap proxy on this store writes the rest"
            )
        if self.reasons:
            out.append("  failures, most common first:")
            for reason in self.reasons:
                out.append(f"    {reason.count} x {reason.text}")
                out.append(f"        e.g. {_shown(reason.example)}")
            if self.other_failures:
                out.append(f"    {self.other_failures} more, for other reasons")
        return out


def summarize(
    store: Store,
    episode_ids: list[str],
    run_dir: Path,
    round: int,
    transparent: bool = False,
    tasks: Mapping[str, Mapping[str, Any]] = {},
) -> CollectSummary:
    """The summary of these episodes (a collect's), their stderr.txt under `run_dir/round-N/EPISODE/`; `tasks`: each
    episode's task, whose field values its failure reason reads as `{field}`."""
    summary = CollectSummary(transparent=transparent)
    with store.connect(read_only=True) as con:
        params: dict[str, Any] = {"ids": episode_ids}
        totals = con.execute(_TOTALS, params).fetchone()
        statuses = con.execute(_STATUSES, params).fetchall()
        fields = [_fields(tasks.get(episode, {})) for episode in episode_ids]
        reasons = con.execute(_REASONS, params | {"fields": fields}).fetchall()
    assert totals is not None
    (
        summary.episodes,
        turns_min,
        turns_median,
        turns_max,
        summary.no_turns,
        summary.no_turns_ok,
        summary.mean_reward,
        summary.rewarded,
        summary.tampered,
        summary.unstored,
    ) = totals
    summary.turns_min, summary.turns_median, summary.turns_max = turns_min or 0, turns_median or 0, turns_max or 0
    summary.statuses = dict(statuses)
    for _, count, example, text in reasons:
        text = _shortened(" ".join(str(text).split()))
        said = VERIFIER_OUTPUT if text.startswith("verifier: ") else "stderr.txt"  # whose output tells why
        summary.reasons.append(Reason(count, text, Path(run_dir) / f"round-{round}" / example / said))
    failures = sum(n for status, n in summary.statuses.items() if status != "ok")
    summary.other_failures = failures - sum(r.count for r in summary.reasons)
    return summary


def _fields(task: Mapping[str, Any]) -> list[dict[str, str]]:
    """A task's text and number fields as (name, value), the longest value first (replaced before its parts)."""
    found = [
        {"name": name, "value": str(value)}
        for name, value in task.items()
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and len(str(value)) >= MIN_FIELD_CHARS
    ]
    return sorted(found, key=lambda field: -len(field["value"]))


def _shown(path: Path) -> str:
    """A path relative to the current directory when it is under it (shorter to read and to paste)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return os.fspath(path)


def _shortened(text: str) -> str:
    """A reason cut to REASON_CHARS: its head ("agent exited 1: ") and its end, where a traceback names the error."""
    if len(text) <= REASON_CHARS:
        return text
    head, sep, _ = text.partition(": ")
    head = head + sep if sep and len(head) < 40 else ""
    return head + "…" + text[len(text) - (REASON_CHARS - len(head) - 1) :]
