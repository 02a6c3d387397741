"""The UI's reads: parameterised SQL over the store's tables and views, one statement per question.

Every statement here reads; the UI attaches the store read-only (lcap.ui.reader). The episode list
is the one that must stay fast on a large store: it filters and sorts the `episodes` table (joined
with the latest rewards) and aggregates turns only for the page's own episodes, never for all of
them as the `episode_summary` view does. Sorting goes through `SORTS`, a whitelist of SQL
expressions; filters are bound parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb

# Sortable columns: URL name -> SQL expression over the filtered episodes `f`.
SORTS = {
    "started": "f.started_at",
    "ended": "f.ended_at",
    "duration": "f.duration_s",
    "reward": "f.reward",
    "round": "f.round",
    "task": "f.task_id",
    "sample": "f.sample",
    "status": "f.status",
    "episode": "f.episode_id",
}
DEFAULT_SORT = ("started", "desc")
PAGE_SIZES = (25, 50, 100, 200)
STATUSES = ("running", "ok", "failed", "timeout", "interrupted", "error")

# Flags an episode can be filtered by: the dataset stage's own (episode_flags.flag values, e.g. tampered,
# verifier_error) plus these, each a condition on the episode's turns or its reward.
TURN_FLAGS = {
    "truncated": "cut_by_token_limit(finish_reason)",
    "rebuilt": "token_source IS NULL OR prompt_token_ids IS NULL OR completion_token_ids IS NULL",
    "failed_call": "error IS NOT NULL OR status_code >= 400",
}
OPTIONAL_TURN_FLAGS = {"stitched": "stitched"}  # columns a newer capture adds; offered when the store has them
# train_runs: the mismatch guard's charted figures, and the same measure after training (the round's step)
MISMATCH_FIGURES = ("mismatch_kl", "mismatch_logp_diff", "mismatch_seconds", "step_kl")
# The list's filters: a field of `EpisodeFilter` -> its condition on the episodes `e` and rewards `r` when it is set.
FILTERS = {
    "round": "e.round = $round",
    "split": "coalesce(e.split, 'train') = $split",
    "task": "e.task_id = $task",
    "q": "(contains(lower(e.episode_id), lower($q)) OR contains(lower(coalesce(e.task_id, '')), lower($q)))",
    "status": "e.status = $status",
    "reward_min": "r.reward >= $reward_min",
    "reward_max": "r.reward <= $reward_max",
}


def columns(con: duckdb.DuckDBPyConnection) -> dict[str, set[str]]:
    """The store's tables and their columns, so pages can show what a newer lcap added and skip what is missing."""
    rows = con.execute(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = current_database()"
    ).fetchall()
    found: dict[str, set[str]] = {}
    for table, column in rows:
        found.setdefault(table, set()).add(column)
    return found


def optional_turn_flags(cols: dict[str, set[str]]) -> list[str]:
    """The flags of `OPTIONAL_TURN_FLAGS` whose column this store's `turns` has."""
    return [name for name, column in OPTIONAL_TURN_FLAGS.items() if column in cols.get("turns", set())]


def _dicts(con: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> list[dict[str, Any]]:
    """`sql`'s rows, each a dict by column name."""
    cursor = con.execute(sql, params)
    names = [d[0] for d in cursor.description or ()]
    return [dict(zip(names, row)) for row in cursor.fetchall()]


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> dict[str, Any] | None:
    rows = _dicts(con, sql, params)
    return rows[0] if rows else None


# --- episodes list ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeFilter:
    """The episode list's query string, parsed and checked (see `from_query`)."""

    round: int | None = None
    split: str | None = None
    task: str | None = None  # exact task id (a group's link)
    q: str | None = None  # substring of the episode id or task id
    status: str | None = None
    flag: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    sort: str = DEFAULT_SORT[0]
    order: str = DEFAULT_SORT[1]
    page: int = 1
    per_page: int = 50
    errors: tuple[str, ...] = field(default=())

    @classmethod
    def from_query(cls, query: dict[str, str], flags: set[str]) -> EpisodeFilter:
        """Parse a query string; a bad value is dropped and named in `errors` (the page says so and still shows)."""
        errors: list[str] = []

        def number(name: str, kind: type) -> Any:
            raw = (query.get(name) or "").strip()
            if not raw:
                return None
            try:
                value = kind(raw)
            except ValueError:
                errors.append(f"{name}: {raw!r} is not a number")
                return None
            if isinstance(value, float) and not math.isfinite(value):
                errors.append(f"{name}: {raw!r} is not a finite number")
                return None
            return value

        def choice(name: str, allowed: set[str] | tuple[str, ...]) -> str | None:
            raw = (query.get(name) or "").strip()
            if raw and raw not in allowed:
                errors.append(f"{name}: unknown value {raw!r}")
                return None
            return raw or None

        def text(name: str) -> str | None:
            return (query.get(name) or "").strip()[:200] or None

        sort = choice("sort", tuple(SORTS)) or DEFAULT_SORT[0]
        order = choice("order", ("asc", "desc")) or (DEFAULT_SORT[1] if sort == DEFAULT_SORT[0] else "asc")
        per_page = number("per_page", int) or 50
        if per_page not in PAGE_SIZES:
            errors.append(f"per_page: use one of {', '.join(map(str, PAGE_SIZES))}")
            per_page = 50
        page = number("page", int) or 1
        return cls(
            round=number("round", int),
            split=text("split"),
            task=text("task"),
            q=text("q"),
            status=choice("status", STATUSES),
            flag=choice("flag", flags),
            reward_min=number("reward_min", float),
            reward_max=number("reward_max", float),
            sort=sort,
            order=order,
            page=max(1, min(page, 1_000_000)),
            per_page=per_page,
            errors=tuple(errors),
        )

    def query(self, **changes: Any) -> dict[str, str]:
        """This filter as query-string items (defaults left out), with `changes` applied: for links."""
        f = replace(self, **changes)
        default_sort = (f.sort, f.order) == DEFAULT_SORT
        items = {
            k: getattr(f, k) for k in ("round", "split", "task", "q", "status", "flag", "reward_min", "reward_max")
        }
        items |= {
            "sort": None if default_sort else f.sort,
            "order": None if default_sort else f.order,
            "page": f.page if f.page != 1 else None,
            "per_page": f.per_page if f.per_page != 50 else None,
        }
        return {k: str(v) for k, v in items.items() if v is not None}


def flag_names(con: duckdb.DuckDBPyConnection, cols: dict[str, set[str]]) -> list[str]:
    """Every flag the list can filter by on this store: the dataset stage's raised ones and the turn conditions."""
    raised = [r[0] for r in con.execute("SELECT DISTINCT flag FROM episode_flags ORDER BY flag").fetchall()]
    return sorted(set(raised) | set(TURN_FLAGS) | set(optional_turn_flags(cols)) | {"no_reward"})


def episode_page(
    con: duckdb.DuckDBPyConnection, f: EpisodeFilter, cols: dict[str, set[str]]
) -> tuple[list[dict[str, Any]], int]:
    """One page of the filtered, sorted episode list and the number of episodes that match."""
    params: dict[str, Any] = {name: getattr(f, name) for name in FILTERS if getattr(f, name) not in (None, "")}
    where = ["true", *(FILTERS[name] for name in params)]
    if f.flag == "no_reward":
        where.append("r.reward IS NULL")
    elif f.flag and (condition := TURN_FLAGS.get(f.flag) or OPTIONAL_TURN_FLAGS.get(f.flag)):
        where.append(f"e.episode_id IN (SELECT episode_id FROM turns WHERE {condition})")
    elif f.flag:
        where.append("e.episode_id IN (SELECT episode_id FROM episode_flags WHERE flag = $flag)")
        params["flag"] = f.flag
    direction = "DESC" if f.order == "desc" else "ASC"
    params |= {"limit": f.per_page, "offset": (f.page - 1) * f.per_page}
    optional = optional_turn_flags(cols)
    optional_sql = "".join(f", bool_or(coalesce({OPTIONAL_TURN_FLAGS[n]}, false)) AS {n}" for n in optional)
    sql = f"""
    WITH f AS (
        SELECT e.episode_id, e.task_id, e.round, coalesce(e.split, 'train') AS split, e.sample, e.status, e.error,
               e.started_at, e.ended_at, epoch(e.ended_at) - epoch(e.started_at) AS duration_s, r.reward,
               count(*) OVER () AS matching
        FROM episodes e LEFT JOIN latest_rewards r USING (episode_id)
        WHERE {" AND ".join(where)}),
    page AS MATERIALIZED (SELECT * FROM f ORDER BY {SORTS[f.sort]} {direction} NULLS LAST, f.episode_id LIMIT $limit OFFSET $offset),
    t AS (  -- turns of the page's episodes only
        SELECT episode_id, count(*) AS n_turns,
               sum(coalesce(prompt_tokens, len(prompt_token_ids))) AS prompt_tokens,
               sum(coalesce(completion_tokens, len(completion_token_ids))) AS completion_tokens,
               count(*) FILTER (WHERE {TURN_FLAGS["failed_call"]}) AS failed_calls,
               bool_or({TURN_FLAGS["truncated"]}) AS truncated,
               bool_or({TURN_FLAGS["rebuilt"]}) AS rebuilt{optional_sql}
        FROM turns WHERE episode_id IN (SELECT episode_id FROM page) GROUP BY episode_id),
    fl AS (
        SELECT episode_id, list(DISTINCT flag ORDER BY flag) AS flags FROM episode_flags
        WHERE episode_id IN (SELECT episode_id FROM page) GROUP BY episode_id)
    SELECT page.*, coalesce(t.n_turns, 0) AS n_turns, t.prompt_tokens, t.completion_tokens,
           coalesce(t.failed_calls, 0) AS failed_calls, coalesce(t.truncated, false) AS truncated,
           coalesce(t.rebuilt, false) AS rebuilt, {"".join(f"coalesce(t.{n}, false) AS {n}, " for n in optional)}
           coalesce(fl.flags, []::VARCHAR[]) AS flags
    FROM page LEFT JOIN t USING (episode_id) LEFT JOIN fl USING (episode_id)
    ORDER BY {SORTS[f.sort].replace("f.", "page.")} {direction} NULLS LAST, page.episode_id
    """
    rows = _dicts(con, sql, params)
    if rows:
        return rows, int(rows[0]["matching"])
    if f.page > 1:  # past the end: say how many match
        (total,) = con.execute(
            f"SELECT count(*) FROM episodes e LEFT JOIN latest_rewards r USING (episode_id) WHERE {' AND '.join(where)}",
            {k: v for k, v in params.items() if k not in ("limit", "offset")},
        ).fetchone() or (0,)
        return [], int(total)
    return [], 0


def filter_choices(con: duckdb.DuckDBPyConnection) -> dict[str, list[Any]]:
    """The values the list's select boxes offer: rounds and splits present in the store."""
    rounds = [
        r[0] for r in con.execute("SELECT DISTINCT round FROM episodes WHERE round IS NOT NULL ORDER BY 1").fetchall()
    ]
    splits = [r[0] for r in con.execute("SELECT DISTINCT coalesce(split, 'train') FROM episodes ORDER BY 1").fetchall()]
    return {"rounds": rounds, "splits": splits}


# --- overview ---------------------------------------------------------------------------------------


def overview(con: duckdb.DuckDBPyConnection, cols: dict[str, set[str]]) -> dict[str, Any]:
    """Per round: rewards by split, episodes by status, turns and tokens, training metrics, loop phase times."""
    totals = _one(
        con,
        """SELECT (SELECT count(*) FROM episodes) AS episodes,
                  (SELECT count(*) FROM episodes WHERE status = 'running') AS running,
                  (SELECT count(*) FROM turns) AS turns,
                  (SELECT count(*) FROM rewards) AS rewards,
                  (SELECT count(DISTINCT episode_id) FROM episode_flags) AS flagged,
                  (SELECT count(*) FROM deployments) AS deployments,
                  (SELECT max(started_at) FROM turns) AS last_turn""",
    )
    rewards = _dicts(
        con,
        """SELECT e.round, coalesce(e.split, 'train') AS split, avg(r.reward) AS mean, count(r.reward) AS n,
                  min(r.reward) AS min, max(r.reward) AS max,
                  count(*) FILTER (WHERE e.status = 'running') AS running
           FROM episodes e LEFT JOIN latest_rewards r USING (episode_id)
           WHERE e.round IS NOT NULL GROUP BY ALL HAVING n > 0 OR running > 0 ORDER BY 1, 2""",
    )
    statuses = _dicts(
        con,
        """SELECT round, coalesce(status, 'unknown') AS status, count(*) AS n FROM episodes
           WHERE round IS NOT NULL GROUP BY ALL ORDER BY 1, 2""",
    )
    turns = _dicts(
        con,
        """SELECT e.round, count(*) AS turns,
                  sum(coalesce(t.prompt_tokens, len(t.prompt_token_ids))) AS prompt_tokens,
                  sum(coalesce(t.completion_tokens, len(t.completion_token_ids))) AS completion_tokens,
                  count(*) FILTER (WHERE t.error IS NOT NULL OR t.status_code >= 400) AS failed_calls,
                  quantile_cont(t.latency_ms, 0.5) AS latency_p50, quantile_cont(t.latency_ms, 0.9) AS latency_p90
           FROM turns t JOIN episodes e USING (episode_id)
           WHERE e.round IS NOT NULL GROUP BY ALL ORDER BY 1""",
    )
    train = _dicts(con, "SELECT * EXCLUDE (config) FROM train_runs ORDER BY round, started_at")
    mismatch = [c for c in MISMATCH_FIGURES if c in cols.get("train_runs", set())]  # a store before them: none
    phases = _dicts(
        con,
        """WITH latest AS (SELECT arg_max(run, created_at) AS run FROM loop_steps)
           SELECT round, step, sum(TRY_CAST(details->>'seconds' AS DOUBLE)) AS seconds
           FROM loop_steps WHERE run = (SELECT run FROM latest) GROUP BY ALL ORDER BY 1, 2""",
    )
    run = con.execute("SELECT arg_max(run, created_at) FROM loop_steps").fetchone()
    undeployed = _dicts(  # rounds (or, with --per-role, a round's roles: `skipped:ROLE`) with nothing to learn, and
        # rounds trained but refused (a held-out gate's or --max-step-kl's `promote` step with `promoted` false)
        con,
        """WITH latest AS (SELECT arg_max(run, created_at) AS run FROM loop_steps)
           SELECT round, nullif(split_part(step, ':', 2), '') AS role,
                  CASE WHEN step = 'promote' THEN 'refused' ELSE 'skipped' END AS verdict,
                  any_value(details->>'reason') AS reason,
                  any_value(coalesce(details->>'kept', details->>'current')) AS kept
           FROM loop_steps
           WHERE run = (SELECT run FROM latest)
             AND (step = 'skipped' OR step LIKE 'skipped:%'
                  OR (step = 'promote' AND TRY_CAST(details->>'promoted' AS BOOLEAN) IS FALSE))
           GROUP BY round, step ORDER BY round, role NULLS FIRST""",
    )
    deployments = _dicts(
        con, "SELECT name, base_model, kind, round, created_at FROM deployments ORDER BY created_at DESC LIMIT 20"
    )
    return {
        "totals": totals or {},
        "rewards": rewards,
        "statuses": statuses,
        "turns": turns,
        "train": train,
        "mismatch": mismatch,
        "phases": phases,
        "run": run[0] if run else None,
        "undeployed": undeployed,
        "deployments": deployments,
    }


# --- one episode ------------------------------------------------------------------------------------

MAX_TURNS = 500  # an episode page shows at most this many calls (the rest: `lcap sql`)


def episode(con: duckdb.DuckDBPyConnection, episode_id: str) -> dict[str, Any] | None:
    return _one(
        con,
        """SELECT e.*, coalesce(e.split, 'train') AS split,
                  epoch(e.ended_at) - epoch(e.started_at) AS duration_s,
                  concat_ws('/', e.round, coalesce(e.split, 'train'), e.task_id) AS group_id,
                  r.reward, r.details AS reward_details, r.source AS reward_source
           FROM episodes e LEFT JOIN latest_rewards r USING (episode_id) WHERE e.episode_id = ?""",
        [episode_id],
    )


def episode_extras(con: duckdb.DuckDBPyConnection, episode_id: str) -> dict[str, list[dict[str, Any]]]:
    """The episode's flags, every reward it was given (the latest counts) and the LLM judge calls that judged it
    (episodes labelled role=judge whose `judged` names it)."""
    flags = _dicts(
        con,
        "SELECT flag, details, created_at FROM episode_flags WHERE episode_id = ? ORDER BY created_at",
        [episode_id],
    )
    rewards = _dicts(
        con,
        "SELECT value, details, source, created_at FROM rewards WHERE episode_id = ? ORDER BY created_at",
        [episode_id],
    )
    judges = _dicts(
        con,
        "SELECT episode_id, status, labels->>'judge_mode' AS mode, started_at FROM episodes "
        "WHERE labels->>'role' = 'judge' AND list_contains(string_split(labels->>'judged', ','), ?) "
        "ORDER BY started_at",
        [episode_id],
    )
    return {"flags": flags, "rewards": rewards, "judges": judges}


_TURN_COLUMNS = (
    "turn_id, seq, started_at, ended_at, latency_ms, ttft_ms, host, path, dialect, transport, stream, upstream, "
    "model_requested, model_served, deployment, status_code, error, finish_reason, completion_text, tool_calls, "
    "reasoning, prompt_tokens, completion_tokens, len(prompt_token_ids) AS n_prompt_ids, "
    "len(completion_token_ids) AS n_completion_ids, token_source, request"
)


def episode_turns(
    con: duckdb.DuckDBPyConnection, episode_id: str, cols: dict[str, set[str]]
) -> tuple[list[dict[str, Any]], int]:
    """The episode's calls in order (request bodies included: the conversation is read from them), and how many."""
    optional = sorted({*OPTIONAL_TURN_FLAGS.values(), "role"})  # role: a store captured since issue #52
    extra = "".join(f", {c}" for c in optional if c in cols.get("turns", set()))
    rows = _dicts(
        con,
        f"""SELECT {_TURN_COLUMNS}{extra}, count(*) OVER () AS n_all FROM turns WHERE episode_id = ?
            ORDER BY seq NULLS LAST, started_at LIMIT {MAX_TURNS}""",
        [episode_id],
    )
    return rows, int(rows[0]["n_all"]) if rows else 0


def raw_turn(con: duckdb.DuckDBPyConnection, turn_id: str, part: str) -> tuple[bool, Any]:
    """(found, JSON text) of one call's request or response body as stored (secrets already removed)."""
    column = {"request": "request", "response": "response"}[part]
    row = con.execute(f"SELECT {column} FROM turns WHERE turn_id = ? LIMIT 1", [turn_id]).fetchone()
    return (row is not None, row[0] if row else None)


def episode_tokens(con: duckdb.DuckDBPyConnection, episode_id: str) -> Any:
    """The episode's calls with their token ids, as build-dataset reads them (`turn_tokens`), as Arrow."""
    return con.sql(
        """SELECT tt.episode_id, tt.seq, tt.deployment, tt.rebuilt, tt.truncated,
                  tt.prompt_ids::INTEGER[] AS prompt_ids, tt.completion_ids::INTEGER[] AS completion_ids,
                  (CASE WHEN len(tt.logprobs) = len(tt.completion_ids) THEN tt.logprobs
                        ELSE list_transform(tt.completion_ids, lambda x: 0.0) END)::FLOAT[] AS logprobs,
                  '' AS group_id
           FROM turn_tokens tt
           WHERE tt.episode_id = ? AND tt.prompt_ids IS NOT NULL AND tt.completion_ids IS NOT NULL
           ORDER BY tt.seq""",
        params=[episode_id],
    ).to_arrow_table()


def base_models(con: duckdb.DuckDBPyConnection, names: list[str]) -> dict[str, str]:
    """Deployment name -> its base model (the tokenizer that decodes its ids)."""
    rows = con.execute(
        """SELECT name, arg_max(base_model, created_at) FROM deployments
           WHERE name IN (SELECT unnest(?::VARCHAR[])) GROUP BY name""",
        [names],
    ).fetchall()
    return {name: base for name, base in rows if base}


def group(con: duckdb.DuckDBPyConnection, round: int | None, split: str, task_id: str) -> list[dict[str, Any]]:
    """Every episode of one GRPO group (a task in a round and split), best reward first, with the advantage
    build-dataset gives it. The `episode_advantages` view computes that for the whole store at once; this is
    its statement narrowed to one group (the same eligibility, latest per key, and formula; a test holds the
    two equal), so a group costs a look-up, not an aggregation of every turn."""
    return _dicts(
        con,
        """WITH g AS (
               SELECT e.episode_id, e.sample, e.status, e.started_at,
                      epoch(e.ended_at) - epoch(e.started_at) AS duration_s, r.reward
               FROM episodes e LEFT JOIN latest_rewards r USING (episode_id)
               WHERE e.round IS NOT DISTINCT FROM $round AND coalesce(e.split, 'train') = $split
                 AND e.task_id = $task),
           t AS (SELECT episode_id, count(*) AS n_turns FROM turns
                 WHERE episode_id IN (SELECT episode_id FROM g) GROUP BY episode_id),
           fl AS (SELECT episode_id, list(DISTINCT flag ORDER BY flag) AS flags FROM episode_flags
                  WHERE episode_id IN (SELECT episode_id FROM g) GROUP BY episode_id),
           kept AS (SELECT episode_id, reward FROM g
                    WHERE $round IS NOT NULL AND status = 'ok' AND reward IS NOT NULL
                    QUALIFY row_number() OVER (PARTITION BY sample ORDER BY started_at DESC) = 1),
           a AS (SELECT episode_id,
                        (reward - avg(reward) OVER ()) / (coalesce(stddev_samp(reward) OVER (), 0) + 1e-4)
                            AS advantage,
                        max(reward) OVER () = min(reward) OVER () AS zero_variance
                 FROM kept)
           SELECT g.*, coalesce(t.n_turns, 0) AS n_turns, coalesce(fl.flags, []::VARCHAR[]) AS flags,
                  a.advantage, a.zero_variance
           FROM g LEFT JOIN t USING (episode_id) LEFT JOIN fl USING (episode_id) LEFT JOIN a USING (episode_id)
           ORDER BY g.reward DESC NULLS LAST, g.sample, g.started_at""",
        {"round": round, "split": split, "task": task_id},
    )


# --- live -------------------------------------------------------------------------------------------


def fingerprint(con: duckdb.DuckDBPyConnection) -> tuple[int, ...]:
    """Counts that change whenever a stage writes something a page shows (a new turn, an episode ending, ...)."""
    row = con.execute(
        """SELECT (SELECT count(*) FROM episodes), (SELECT count(*) FROM episodes WHERE status = 'running'),
                  (SELECT count(*) FROM turns), (SELECT count(*) FROM rewards), (SELECT count(*) FROM episode_flags),
                  (SELECT count(*) FROM train_runs), (SELECT count(*) FROM loop_steps),
                  (SELECT count(*) FROM deployments), (SELECT count(*) FROM dataset_reports)"""
    ).fetchone()
    return tuple(int(v) for v in row) if row else ()
