"""Why a round has little or nothing to train on, read from build-dataset's report: each loss on the way from
episodes to samples, counted, with the option or command that changes it.

`causes(report)` lists them in the order the pipeline loses things (episodes that did not finish, no reward,
no usable call, groups without signal, samples dropped by a cleaning rule); `explain` joins them into the one
line that build-dataset, train and loop print when a round has nothing to train on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Cause:
    """One reason samples were lost: what happened (with its counts) and what to do about it."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}"


NO_CALLS_FIX = "does it ignore proxy settings? try --transparent"
# with --transparent every TCP connection reaches lcap: an episode without a turn made no call lcap knows as one
NO_CALLS_FIX_TRANSPARENT = (
    "with --transparent its every connection reached lcap: does it call an API lcap knows (chat completions, "
    "completions, Responses, Anthropic Messages)? its stderr.txt may say"
)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def causes(report: Any) -> list[Cause]:
    """Every loss the report counts, in pipeline order. `report` is a BuildReport or its dict (report.json)."""
    r = report if isinstance(report, Mapping) else dataclasses.asdict(report)
    episodes: Mapping[str, int] = r.get("episodes") or {}
    groups: Mapping[str, int] = r.get("groups") or {}
    turns: Mapping[str, int] = r.get("turns") or {}
    samples: Mapping[str, int] = r.get("sample_counts") or {}
    options: Mapping[str, Any] = r.get("options") or {}
    rnd, split = r.get("round"), r.get("split", "train")

    total = episodes.get("total", 0)
    if not total and options.get("where"):
        chosen = f"of round {rnd} " if rnd is not None else ""
        return [
            Cause(
                f"no {split} episode {chosen}matches --where {options['where']}",
                'check the condition with `lcap sql "SELECT * FROM episode_selection WHERE ..."` '
                "(build-dataset also reads --split)",
            )
        ]
    if not total:
        return [
            Cause(
                f"the store has no {split} episode of round {rnd}",
                f"collect them with `lcap collect --round {rnd}` (build-dataset reads --round and --split)",
            )
        ]

    return [
        *_episode_causes(episodes, options),
        *_unusable_causes(episodes, turns),
        *_group_causes(groups, samples, options),
        *_sample_causes(samples, turns, options),
    ]


def _episode_causes(episodes: Mapping[str, int], options: Mapping[str, Any]) -> list[Cause]:
    """Episodes that did not finish ok, and finished ones without a reward."""
    out: list[Cause] = []
    total = episodes.get("total", 0)
    failed, timeout, error, unfinished = (episodes.get(k, 0) for k in ("failed", "timeout", "error", "unfinished"))
    if failed + timeout + error + unfinished:
        parts = [
            f"{n} {what}"
            for n, what in (
                (failed, "failed (agent exit code not 0)"),
                (timeout, "timed out"),
                (error, "error (verifier or set-up)"),
                (unfinished, "unfinished (running or interrupted)"),
            )
            if n
        ]
        fixes = [
            "see each one's reason in its stderr.txt or `lcap sql \"select episode_id, status, error from episodes where status <> 'ok'\"`"
        ]
        if timeout:
            fixes.append("raise --timeout")
        if unfinished:
            fixes.append("rerun the same `lcap collect` to finish them")
        out.append(
            Cause(
                f"{failed + timeout + error + unfinished} of {total} episodes did not finish ok: {', '.join(parts)}",
                "; ".join(fixes),
            )
        )

    finished = total - failed - timeout - error - unfinished
    no_reward = episodes.get("no_reward", 0)
    source = options.get("reward_source")
    if no_reward and source:
        out.append(
            Cause(
                f"{no_reward} of {finished} finished episodes have no reward from --reward-source {source}",
                f"score them with `lcap rescore --source {source} --verifier CMD --where ...`",
            )
        )
    elif no_reward:
        out.append(
            Cause(
                f"{no_reward} of {finished} finished episodes have no reward",
                "collect with --verifier, or reward them with `lcap reward EPISODE VALUE`",
            )
        )

    return out


def _unusable_causes(episodes: Mapping[str, int], turns: Mapping[str, int]) -> list[Cause]:
    """Rewarded episodes with no LLM call a sample can be made of, and why."""
    out: list[Cause] = []
    rewarded = episodes.get("rewarded", 0)
    unusable = episodes.get("no_usable_turns", 0)
    if unusable:
        why, fix = [], []
        if not turns.get("total", 0):
            why.append("no LLM call of theirs was captured: the agent made no LLM call through lcap")
            fix.append(NO_CALLS_FIX)
        if turns.get("failed_calls", 0):
            why.append(f"{turns['failed_calls']} of {turns.get('total', 0)} calls failed (HTTP error or no answer)")
            fix.append("see turns.error and turns.status_code with `lcap sql`")
        if turns.get("unrebuildable", 0):
            why.append(f"{turns['unrebuildable']} calls have no token ids and could not be re-tokenised")
            fix.append("pass --tokenizer (the policy's tokenizer)")
        detail = f" ({'; '.join(why)})" if why else ""
        out.append(
            Cause(
                f"{unusable} of {rewarded} rewarded episodes have no usable LLM call{detail}",
                "; ".join(fix) or "see their turns with `lcap sql`",
            )
        )

    return out


def _group_causes(groups: Mapping[str, int], samples: Mapping[str, int], options: Mapping[str, Any]) -> list[Cause]:
    """Groups GRPO cannot learn from: a single episode, or the same reward for every sample."""
    out: list[Cause] = []
    grouped = options.get("format", "grpo") != "sft"  # an SFT sample needs no group: none is lost for want of one
    singleton = groups.get("singleton", 0) if grouped else 0
    group_total = groups.get("total", 0)
    if singleton:
        out.append(
            Cause(
                f"{singleton} of {group_total} groups have a single rewarded episode (GRPO compares samples of one task)",
                "collect with --group-size 2 or more, or build with --advantage batch or rloo (a baseline over "
                "every chosen episode: no repeated prompt needed)",
            )
        )
    equal = groups.get("zero_variance", 0)
    if grouped and equal > 0 and not options.get("keep_zero_variance"):
        out.append(
            Cause(
                f"{equal} of {group_total} groups got the same reward for every sample and were dropped "
                f"({samples.get('zero_variance', 0)} samples; GRPO learns nothing from them)",
                "a larger --group-size, tasks of mixed difficulty or a graded verifier "
                "(--keep-zero-variance keeps them, with advantage 0)",
            )
        )

    return out


def _sample_causes(samples: Mapping[str, int], turns: Mapping[str, int], options: Mapping[str, Any]) -> list[Cause]:
    """Samples dropped by the build's options: truncated ones, tampered ones."""
    out: list[Cause] = []
    truncated = samples.get("truncated", 0)
    if truncated and options.get("truncated", "drop") == "drop":
        calls = turns.get("truncated", 0)
        out.append(
            Cause(
                f"{calls} of {turns.get('total', 0)} calls hit the token limit and their {plural(truncated, 'sample')} "
                "were dropped (--truncated drop)",
                "build with --truncated mask, or raise the agent's max_tokens",
            )
        )

    tampered = samples.get("tampered", 0)
    if tampered and options.get("drop_tampered"):
        out.append(
            Cause(
                f"{plural(tampered, 'tampered sample')} dropped (--drop-tampered)",
                "build without --drop-tampered to keep them as negatives (reward 0)",
            )
        )
    return out


def explain(report: Any, *, extra: list[Cause] | tuple[Cause, ...] = ()) -> str:
    """The causes as one line (`extra`: losses of a later stage, e.g. train's stale samples, appended)."""
    found = (causes(report) if report is not None else []) + list(extra)
    if not found:
        return "no loss counted in the report"
    return "; ".join(str(c) for c in found)


def lost_lines(data: Any) -> list[str]:
    """`lost: CAUSE` for each loss counted in the report.json in the folder `data` (the lines build-dataset prints,
    for train and loop to print too); none when there is no readable report there."""
    try:
        report = json.loads((Path(data) / "report.json").read_text())
    except (OSError, ValueError):
        return []
    return [f"lost: {cause}" for cause in causes(report)]
