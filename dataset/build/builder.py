"""`lcap build-dataset`: captured turns + verifier rewards -> GRPO samples in Parquet.

The joins, the multi-turn merge, the advantages and the cleaning are SQL views of the store
(`episode_advantages`, `turn_tokens`, `samples` in lcap.schema), so what `lcap sql` shows is what
the trainer gets. DuckDB joins turns x episodes x latest rewards x deployments; the multi-turn
merge itself runs vectorised on the Arrow buffers of that result (lcap.dataset.build.merge: the same
rule as the `samples` view, without its per-call list comparisons in SQL;
benchmarks/bench_build_dataset.py times the build); Python otherwise only re-tokenises turns
captured without token ids (cached in `rebuilt_turns`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lcap.config import LcapError
from lcap.dataset.build.export import conversations
from lcap.dataset.build.export_schema import MESSAGE
from lcap.dataset.build.merge import merge_turns
from lcap.dataset.build.rebuild import load_tokenizer, rebuild_missing_tokens, rerender_changes
from lcap.dataset.build.samples_file import SAMPLES_FILE, sample_weights, write_samples
from lcap.dataset.build.select import select_episodes
from lcap.dataset.options import BuildOptions
from lcap.display import rounded
from lcap.store import Store, now

# What each --advantage computes, as the report says it (the SQL is `advantages_by` in lcap.schema).
ADVANTAGES = {
    "group": "(reward - group mean) / (group sample std, ddof=1, + 1e-4): TRL's GRPO scaling",
    "batch": "(reward - batch mean) / (batch sample std, ddof=1, + 1e-4): REINFORCE++'s global normalisation",
    "rloo": "reward - mean reward of the batch's other episodes: RLOO's leave-one-out baseline over the batch",
}
ADVANTAGE = ADVANTAGES["group"]

# One row per successful call of the round's trainable episodes, with its episode's reward and
# advantage; lcap.dataset.build.merge turns them into samples (the rule the `samples` view states).
_TURNS = """
SELECT tt.episode_id, tt.seq, tt.thread, tt.deployment, tt.rebuilt, tt.truncated,
       tt.prompt_ids::INTEGER[] AS prompt_ids, tt.completion_ids::INTEGER[] AS completion_ids,
       (CASE WHEN len(tt.logprobs) = len(tt.completion_ids) THEN tt.logprobs
             ELSE list_transform(tt.completion_ids, lambda x: 0.0) END)::FLOAT[] AS logprobs,
       a.task_id, a.round::INTEGER AS round, a.group_id, a.reward, a.advantage, a.zero_variance, a.tampered
FROM turn_tokens tt JOIN {advantages} a USING (episode_id)
WHERE {a_chosen} AND {tt_role} AND tt.prompt_ids IS NOT NULL AND tt.completion_ids IS NOT NULL
"""

# --format sft: a call no policy deployment served (a teacher API's) takes its ids re-rendered with the student's
# template (rebuilt_turns), whatever ids its server gave; a policy's call keeps its captured ids.
_SFT_TURNS = """
WITH rb AS (SELECT turn_id, prompt_token_ids, completion_token_ids FROM rebuilt_turns
            QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at DESC) = 1),
s AS (
    SELECT tt.episode_id, tt.seq, tt.thread, tt.deployment, tt.rebuilt OR tt.deployment IS NULL AS rebuilt,
           tt.truncated, tt.logprobs,
           CASE WHEN tt.deployment IS NULL THEN rb.prompt_token_ids ELSE tt.prompt_ids END AS prompt_ids,
           CASE WHEN tt.deployment IS NULL THEN rb.completion_token_ids ELSE tt.completion_ids END AS completion_ids,
           a.task_id, a.round, a.group_id, a.reward, a.advantage, a.zero_variance, a.tampered
    FROM turn_tokens tt JOIN {advantages} a USING (episode_id) LEFT JOIN rb USING (turn_id)
    WHERE {a_chosen} AND {tt_role})
SELECT episode_id, seq, thread, deployment, rebuilt, truncated,
       prompt_ids::INTEGER[] AS prompt_ids, completion_ids::INTEGER[] AS completion_ids,
       (CASE WHEN NOT rebuilt AND len(logprobs) = len(completion_ids) THEN logprobs
             ELSE list_transform(completion_ids, lambda x: 0.0) END)::FLOAT[] AS logprobs,
       task_id, round::INTEGER AS round, group_id, reward, advantage, zero_variance, tampered
FROM s WHERE prompt_ids IS NOT NULL AND completion_ids IS NOT NULL
"""

# The chosen teacher calls that were re-rendered, to tell what re-rendering changed.
_RERENDERED = """
WITH rb AS (SELECT * FROM rebuilt_turns QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at DESC) = 1)
SELECT t.turn_id, t.completion_text, t.tool_calls::VARCHAR, rb.completion_token_ids, rb.tokenizer
FROM turns t JOIN rb USING (turn_id)
SEMI JOIN (SELECT episode_id FROM {advantages} a WHERE {a_chosen}) e USING (episode_id)
WHERE t.deployment IS NULL AND {turn_role}
ORDER BY t.turn_id
"""
MAX_CHANGE_EXAMPLES = 10


@dataclass
class BuildReport:
    round: int | None  # None: a --where selection of any rounds
    split: str
    out: str
    samples: int = 0
    episodes: dict[str, int] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)
    turns: dict[str, int] = field(default_factory=dict)
    sample_counts: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    advantage: str = ADVANTAGE
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase
    sft: dict[str, Any] = field(default_factory=dict)  # --format sft: turns by kind, what re-rendering changed
    role: str | None = None  # --role: the one role whose calls were built (None: every call)
    roles: dict[str, dict[str, int]] = field(default_factory=dict)  # the chosen episodes' calls and episodes by role

    def title(self) -> str:
        """What was built: `round N (split)`, with the role and the --where condition when there are."""
        where = self.options.get("where")
        chosen = f"round {self.round}" if self.round is not None else "every round"
        role = f" role {self.role}" if self.role is not None else ""
        return f"{chosen} ({self.split}){role}" + (f" where {where}" if where else "")

    def lines(self) -> list[str]:
        """The report as a few human lines (what the CLI prints)."""
        fmt = lambda d: ", ".join(f"{k} {v}" for k, v in d.items())  # noqa: E731
        return [
            f"{self.title()}: {self.samples} samples -> {self.out}  [{self.seconds:.1f}s]",
            f"episodes: {fmt(self.episodes)}",
            f"groups: {fmt(self.groups)}",
            f"turns: {fmt(self.turns)}",
            f"samples: {fmt(self.sample_counts)}",
            "roles: " + ", ".join(f"{r} {n['calls']} calls in {n['episodes']} episodes" for r, n in self.roles.items()),
            f"advantage: {self.advantage}"
            + (f", over the episodes with a call of role {self.role}" if self.role else ""),
            f"timings (s): {fmt(self.timings)}",
        ] + (
            [f"sft turns: {fmt(self.sft['turns'])}", f"re-rendering changed: {fmt(self.sft['rerender_changes'])}"]
            if self.sft
            else []
        )


def build_dataset(
    store: Store,
    *,
    round: int | None,
    out: Path,
    options: BuildOptions = BuildOptions(),
    groups: Sequence[str] | None = None,
    role: str | None = None,
) -> BuildReport:
    """Write `out/samples.parquet` and `out/report.json` for the `options.split` episodes of `round`, or with
    `groups` for those GRPO groups (of any round: an async loop step's batch; `round` then names the step).
    With `options.where`, the episodes that condition picks from `episode_selection` (of `round` when it is
    given, of every round when it is None) are the population: their groups and advantages are theirs alone.
    With `role`, only that role's calls (`turns.role`) make samples, and the population is the chosen episodes
    with a call of that role: each keeps its episode's reward, and its advantage is computed over them alone
    (the per-role baseline); a role without a call there is a one-line error naming the roles there are."""
    started = time.perf_counter()
    if round is None and options.where is None and groups is None:
        raise LcapError("build-dataset needs --round, --where or both")
    round = None if round is None else int(round)
    out = Path(out)
    report = BuildReport(
        round=round, split=options.split, out=str(out), options=asdict(options), advantage=ADVANTAGES[options.advantage]
    )
    clock = _Clock(report.timings, started)
    chosen = _choose(store, round, groups, options, role is not None)
    report.roles = _role_counts(store, chosen, options.split)
    if role is not None:
        chosen = _of_role(store, chosen, role, report)
        report.role = role
    clock("select")
    made = not out.exists()  # a folder made here and left empty is removed: nothing to train on leaves nothing
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LcapError(f"cannot write {out}: {exc.strerror or exc}") from None
    sft = options.format == "sft"

    rebuilt, unrebuildable = _rebuild(store, round, groups, chosen.episodes, options) if options.rebuild else (0, 0)
    clock("rebuild")
    params = chosen.params(options.split)
    with store.connect() as con:
        turns = con.sql(chosen(_SFT_TURNS if sft else _TURNS), params=params).to_arrow_table()
        clock("turns_sql")
        report.episodes = _one(con, chosen(_EPISODE_COUNTS), params)
        report.groups = _one(con, chosen(_GROUP_COUNTS), params)
        report.turns = _one(con, chosen(_TURN_COUNTS), params) | {
            "rebuilt_now": rebuilt,
            "unrebuildable": unrebuildable,
        }
        clock("counts_sql")
        if sft:
            report.sft = {"turns": _turn_kinds(turns), "rerender_changes": _rerender_changes(con, chosen, params)}
            clock("sft_report")
    report.episodes["no_usable_turns"] = report.episodes["rewarded"] - len(pc.unique(turns["episode_id"]))

    samples = merge_turns(turns, mask_truncated=options.truncated == "mask")
    clock("merge")
    keep, report.sample_counts = _keep(samples, options, sft)
    report.samples = report.sample_counts["written"]
    sizes = pc.value_counts(samples["group_id"].filter(pa.array(keep))).field("counts")
    report.groups["trainable"] = int(pc.sum(pc.greater_equal(sizes, 2)).as_py() or 0)  # GRPO needs two per group

    written = samples.filter(pa.array(keep))
    written = written.append_column("weight", sample_weights(written["episode_id"], options.sample_weight))
    if report.samples:  # else no file: an earlier build's stay as they were, the store's row says why (`last_report`)
        write_samples(written, out / SAMPLES_FILE, _conversations(store, written, chosen.role) if sft else None)
    clock("write")
    report.seconds = rounded(time.perf_counter() - started)
    store.execute(
        "INSERT INTO dataset_reports (round, split, out, report, created_at) VALUES (?, ?, ?, ?, ?)",
        [round, options.split, str(out), json.dumps(asdict(report)), now()],
    )
    if report.samples:
        (out / "report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    elif made and not any(out.iterdir()):
        out.rmdir()
    return report


def _keep(samples: pa.Table, options: BuildOptions, sft: bool) -> tuple[np.ndarray, dict[str, int]]:
    """Which merged samples the options keep, and the report's sample counts."""
    keep = np.ones(len(samples), dtype=bool)
    flags = {
        name: samples[name].to_numpy(zero_copy_only=False).astype(bool)
        for name in ("zero_variance", "tampered", "truncated", "merged", "rebuilt")
    }
    if not options.keep_zero_variance and not sft:  # supervised samples need no group
        keep &= ~flags["zero_variance"]
    if options.drop_tampered:
        keep &= ~flags["tampered"]
    if options.truncated == "drop":
        keep &= ~flags["truncated"]
    split_episodes = samples["episode_id"].filter(pa.array(samples["part"].to_numpy() > 0))
    counts = {
        "built": len(samples),
        "written": int(keep.sum()),
        "merged": int(flags["merged"].sum()),
        "single_call": int((~flags["merged"]).sum()),
        "zero_variance": int(flags["zero_variance"].sum()),
        "truncated": int(flags["truncated"].sum()),
        "truncated_masked": int((flags["truncated"] & keep).sum()) if options.truncated == "mask" else 0,
        "truncated_kept": int((flags["truncated"] & keep).sum()) if options.truncated == "keep" else 0,
        "tampered": int(flags["tampered"].sum()),
        "rebuilt": int(flags["rebuilt"].sum()),
        "episodes_split": len(pc.unique(split_episodes)),
        "split_at_deploy": int(samples["after_deploy"].to_numpy(zero_copy_only=False).astype(bool).sum()),
    }
    return keep, counts


def _rebuild(
    store: Store, round: int | None, groups: Sequence[str] | None, episodes: Any, options: BuildOptions
) -> tuple[int, int]:
    """Token ids rebuilt now for the chosen episodes' calls that lack them: (rebuilt, could not be rebuilt)."""
    rebuilt = unrebuildable = 0
    for source in _source_rounds(store, round, groups, episodes):
        done, failed = rebuild_missing_tokens(
            store,
            round=source,
            split=options.split,
            tokenizer=options.tokenizer,
            teachers=options.format == "sft",
            episodes=None if episodes is None else list(episodes),
        )
        rebuilt, unrebuildable = rebuilt + done, unrebuildable + failed
    return rebuilt, unrebuildable


def last_report(store: Store, out: Path) -> dict[str, Any] | None:
    """The report of the latest build into `out` (one that wrote nothing has no report.json), or None."""
    rows = store.fetchall(
        "SELECT report FROM dataset_reports WHERE out = ? ORDER BY created_at DESC LIMIT 1", [str(Path(out))]
    )
    return json.loads(rows[0][0]) if rows else None


def _turn_kinds(turns: pa.Table) -> dict[str, int]:
    """An SFT dataset's calls by where their ids come from."""
    teacher = pc.is_null(turns["deployment"]).to_numpy(zero_copy_only=False)
    rebuilt = turns["rebuilt"].to_numpy(zero_copy_only=False).astype(bool)
    return {
        "policy_captured": int((~teacher & ~rebuilt).sum()),
        "policy_rebuilt": int((~teacher & rebuilt).sum()),
        "teacher_rerendered": int(teacher.sum()),
    }


def _rerender_changes(con, chosen: _Chosen, params: dict[str, Any]) -> dict[str, Any]:
    """Where re-rendering a teacher's call with the student's template changed its text (whitespace) or its
    tool calls' JSON: counts, and the first turns of each."""
    counts: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    for turn_id, text, tool_calls, ids, name in con.execute(chosen(_RERENDERED), params).fetchall():
        decoded = load_tokenizer(name).decode(ids, skip_special_tokens=True)
        for change in rerender_changes(decoded, text, json.loads(tool_calls or "null")):
            counts[change] += 1
            if len(examples.setdefault(change, [])) < MAX_CHANGE_EXAMPLES:
                examples[change].append(turn_id)
    return {change: counts[change] for change in ("whitespace", "tool JSON", "text")} | {"turns": examples}


def _conversations(store: Store, samples: pa.Table, role: str | None) -> pa.Table:
    """Each sample's episode's conversation (messages, tools), as `lcap export` writes it: the build's role's, else
    the one of the episode's call with the most messages."""
    episodes = samples["episode_id"].to_pylist()
    with store.connect(read_only=True) as con:
        by_episode = {
            r["episode_id"]: r
            for r in conversations(con, sorted(set(episodes)), tokens=False)
            if (r["role"] == role if role is not None else r["rank"] == 1)
        }
    return pa.table(
        {
            "messages": pa.array([(by_episode.get(e) or {}).get("messages") for e in episodes], pa.list_(MESSAGE)),
            "tools": pa.array([(by_episode.get(e) or {}).get("tools") for e in episodes], pa.string()),
        }
    )


@dataclass(frozen=True)
class _Chosen:
    """The episodes a build reads, all of one split: a round's, the listed groups', or a --where selection's
    (of one round or of all); a selection's advantages come from `advantages_over` its episodes alone. With
    `role`, the calls it reads are that role's (`{tt_role}` on `turn_tokens tt`, `{turn_role}` on `turns`)."""

    round: int | None
    groups: Sequence[str] | None
    episodes: Sequence[str] | None
    method: str = "group"
    source: str | None = None
    role: str | None = None

    def params(self, split: str) -> dict[str, Any]:
        params: dict[str, Any] = {"split": split}
        if self.groups is not None:
            params["groups"] = list(self.groups)
        elif self.round is not None:
            params["round"] = self.round
        if self.episodes is not None:
            params["episodes"] = list(self.episodes)
        return params

    def __call__(self, sql: str) -> str:
        """`sql` over the chosen episodes."""
        conditions = ["split = $split"]
        if self.groups is not None:
            conditions.append("group_id IN (SELECT unnest($groups::VARCHAR[]))")
        elif self.round is not None:
            conditions.append("round = $round")
        advantages = "episode_advantages"
        if self.episodes is not None:
            conditions.append("episode_id IN (SELECT unnest($episodes::VARCHAR[]))")
            advantages = f"advantages_by($episodes::VARCHAR[], '{self.method}', {_literal(self.source)})"
        role = None if self.role is None else _literal(self.role)
        return sql.format(
            chosen=" AND ".join(conditions),
            a_chosen=" AND ".join(f"a.{c}" for c in conditions),
            advantages=advantages,
            rewards=f"rewards_from({_literal(self.source)})",
            tt_role="true"
            if role is None
            else f"tt.turn_id IN (SELECT turn_id FROM turns WHERE turn_role(role) = {role})",
            turn_role="true" if role is None else f"turn_role(role) = {role}",
        )


def _choose(
    store: Store, round: int | None, groups: Sequence[str] | None, options: BuildOptions, named: bool
) -> _Chosen:
    """The episodes a build reads; `named`: list them even where the round or the groups alone would say which."""
    episodes = None if options.where is None else select_episodes(store, options.where)
    by_population = episodes is None and (options.advantage != "group" or options.reward_source is not None or named)
    if by_population:  # the baseline's population, the reward source and a role need the chosen episodes named
        episodes = _population(store, round, groups, options.split)
    if by_population and groups is not None:  # the groups' episodes, of any round (`round` names the async step)
        return _Chosen(None, None, episodes, options.advantage, options.reward_source)
    return _Chosen(round, groups, episodes, options.advantage, options.reward_source)


def _literal(text: str | None) -> str:
    """`text` as a SQL string literal (NULL for None)."""
    return "NULL::VARCHAR" if text is None else "'" + text.replace("'", "''") + "'"


def _population(store: Store, round: int | None, groups: Sequence[str] | None, split: str) -> list[str]:
    """The episodes of `round` (or of `groups`) and `split`: the population a batch baseline or a reward source
    is computed over when no --where names it."""
    chosen = _Chosen(round, groups, None)
    return [
        r[0]
        for r in store.fetchall(chosen("SELECT episode_id FROM episode_summary WHERE {chosen}"), chosen.params(split))
    ]


# The chosen episodes' successful calls (`turn_tokens`, the calls a build reads) by role.
_ROLE_COUNTS = """
WITH e AS (SELECT episode_id FROM episode_summary WHERE {chosen}),
     r AS (SELECT turn_id, turn_role(any_value(role)) AS role FROM turns SEMI JOIN e USING (episode_id) GROUP BY turn_id)
SELECT r.role, count(*) AS calls, count(DISTINCT tt.episode_id) AS episodes
FROM turn_tokens tt SEMI JOIN e USING (episode_id) JOIN r USING (turn_id)
GROUP BY r.role ORDER BY r.role
"""

# The chosen episodes with a successful call of the role: a per-role build's population.
_ROLE_EPISODES = """
SELECT DISTINCT episode_id FROM turn_tokens tt
WHERE {tt_role} AND episode_id IN (SELECT episode_id FROM episode_summary WHERE {chosen}) ORDER BY episode_id
"""


def _role_counts(store: Store, chosen: _Chosen, split: str) -> dict[str, dict[str, int]]:
    """The chosen episodes' calls and episodes by role."""
    rows = store.fetchall(chosen(_ROLE_COUNTS), chosen.params(split))
    return {role: {"calls": calls, "episodes": episodes} for role, calls, episodes in rows}


def _of_role(store: Store, chosen: _Chosen, role: str, report: BuildReport) -> _Chosen:
    """`chosen` narrowed to `role`: its episodes with a call of that role, and of theirs that role's calls only."""
    if role not in report.roles:
        there = ", ".join(report.roles) or "none (no successful call)"
        held = [r[0] for r in store.fetchall("SELECT DISTINCT turn_role(role) FROM turns ORDER BY 1")]
        raise LcapError(
            f"--role {role}: no call of that role in {report.title()} (roles there: {there}); "
            f"the store holds roles: {', '.join(held) or 'none (no call)'}"
        )
    narrowed = replace(chosen, role=role)
    episodes = [r[0] for r in store.fetchall(narrowed(_ROLE_EPISODES), chosen.params(report.split))]
    return replace(narrowed, episodes=episodes)


def _source_rounds(
    store: Store, round: int | None, groups: Sequence[str] | None, episodes: Sequence[str] | None
) -> list[int]:
    """The rounds the chosen episodes were collected in (with `groups`, `round` names an async step, not a round)."""
    if groups is None and episodes is None and round is not None:
        return [round]
    if groups is not None:
        sql, ids = "group_id IN (SELECT unnest(?::VARCHAR[]))", list(groups)
    else:
        sql, ids = "episode_id IN (SELECT unnest(?::VARCHAR[]))", list(episodes or [])
    rows = store.fetchall(f"SELECT DISTINCT round FROM episode_summary WHERE {sql} ORDER BY 1", [ids])
    return [r[0] for r in rows if r[0] is not None and (groups is not None or round is None or r[0] == round)]


class _Clock:
    def __init__(self, timings: dict[str, float], since: float) -> None:
        self.timings, self.last = timings, since

    def __call__(self, phase: str) -> None:
        t = time.perf_counter()
        self.timings[phase] = rounded(t - self.last)
        self.last = t


def _one(con, sql: str, params: dict[str, Any]) -> dict[str, int]:
    cursor = con.execute(sql, params) if params else con.execute(sql)
    row = cursor.fetchone()
    return {d[0]: (int(v) if v is not None else 0) for d, v in zip(cursor.description, row)}


# Every episode of the round and split, by why it does or does not train.
_EPISODE_COUNTS = """
WITH e AS (SELECT *, episode_id IN (SELECT episode_id FROM {rewards}) AS rewarded FROM episode_summary WHERE {chosen}),
     a AS (SELECT * FROM {advantages} WHERE {chosen})
SELECT (SELECT count(*) FROM e) AS total,
       (SELECT count(*) FILTER (WHERE status = 'failed') FROM e) AS failed,
       (SELECT count(*) FILTER (WHERE status = 'timeout') FROM e) AS timeout,
       (SELECT count(*) FILTER (WHERE status = 'error') FROM e) AS error,
       (SELECT count(*) FILTER (WHERE status NOT IN ('ok', 'failed', 'timeout', 'error') OR status IS NULL) FROM e)
           - (SELECT count(*) FROM a WHERE status = 'running') AS unfinished,
       (SELECT count(*) FROM a WHERE status = 'running') AS live_sessions,
       (SELECT count(*) FILTER (WHERE status = 'ok' AND NOT rewarded) FROM e) AS no_reward,
       (SELECT count(*) FILTER (WHERE status = 'ok' AND rewarded) FROM e) + (SELECT count(*) FROM a WHERE status = 'running')
           - (SELECT count(*) FROM a) AS duplicate,
       (SELECT count(*) FILTER (WHERE list_contains(flags, 'tampered')) FROM e) AS tampered,
       (SELECT count(*) FILTER (WHERE zero_variance) FROM a) AS zero_variance,
       (SELECT count(*) FROM a) AS rewarded
"""

# zero_variance: groups of two or more whose rewards were all equal (a single-episode group is `singleton`, not both).
_GROUP_COUNTS = """
SELECT count(*) AS total, count(*) FILTER (WHERE zero_variance AND group_size > 1) AS zero_variance,
       count(*) FILTER (WHERE group_size = 1) AS singleton, coalesce(max(group_size), 0) AS max_size
FROM (SELECT group_id, any_value(zero_variance) AS zero_variance, any_value(group_size) AS group_size
      FROM {advantages} WHERE {chosen} GROUP BY group_id)
"""

_TURN_COUNTS = """
WITH e AS (SELECT episode_id FROM episode_summary WHERE {chosen}),
     t AS (SELECT * FROM turns WHERE episode_id IN (SELECT episode_id FROM e) AND {turn_role})
SELECT count(*) AS total, count(*) - count(DISTINCT turn_id) AS duplicate,
       count(*) FILTER (WHERE error IS NOT NULL OR status_code >= 400) AS failed_calls,
       count(*) FILTER (WHERE cut_by_token_limit(finish_reason)) AS truncated,
       count(*) FILTER (WHERE token_source IS NULL OR prompt_token_ids IS NULL) AS without_token_ids
FROM t
"""
