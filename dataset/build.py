"""`lcap build-dataset`: captured turns + verifier rewards -> GRPO samples in Parquet.

The joins, the multi-turn merge, the advantages and the cleaning are SQL views of the store
(`episode_advantages`, `turn_tokens`, `samples` in lcap.schema), so what `lcap sql` shows is what
the trainer gets. Python only re-tokenises turns captured without token ids (cached in
`rebuilt_turns`), writes the Parquet file through DuckDB's COPY and counts what was dropped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lcap.config import LcapError
from lcap.store import Store, now

ADVANTAGE = "(reward - group mean) / (group sample std, ddof=1, + 1e-4): TRL's GRPO scaling"

# The column types the trainer reads (lcap.train reads exactly this file).
_SAMPLE_COLUMNS = """
    sample_id::VARCHAR AS sample_id, episode_id::VARCHAR AS episode_id, task_id::VARCHAR AS task_id,
    round::INTEGER AS round, group_id::VARCHAR AS group_id,
    prompt_ids::INTEGER[] AS prompt_ids, completion_ids::INTEGER[] AS completion_ids,
    logprobs::FLOAT[] AS logprobs, {env_mask}::TINYINT[] AS env_mask,
    reward::DOUBLE AS reward, advantage::DOUBLE AS advantage, deployment::VARCHAR AS deployment,
    rebuilt::BOOLEAN AS rebuilt, truncated::BOOLEAN AS truncated, n_turns::INTEGER AS n_turns,
    merged::BOOLEAN AS merged
"""

# A truncated completion has no stop token and none is appended: "mask" keeps the sample but
# zeroes the env_mask of the truncated call's tokens, "drop" leaves the sample out.
_MASKED_ENV = """CASE WHEN truncated THEN list_concat(list_slice(env_mask, 1, len(env_mask) - last_completion_len),
                                                list_transform(range(last_completion_len), lambda x: 0))
                 ELSE env_mask END"""


@dataclass(frozen=True)
class BuildOptions:
    """Cleaning choices of `build-dataset`; the defaults are what GRPO wants."""

    split: str = "train"
    truncated: Literal["drop", "mask"] = "drop"
    keep_zero_variance: bool = False   # groups whose rewards are all equal carry no GRPO signal
    drop_tampered: bool = False        # tampered episodes already have reward 0: keep them as negatives
    rebuild: bool = True               # re-tokenise turns captured without token ids
    tokenizer: str | None = None       # tokenizer for rebuilds (default: the deployment's base model)


@dataclass
class BuildReport:
    round: int
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The report as a few human lines (what the CLI prints)."""
        fmt = lambda d: ", ".join(f"{k} {v}" for k, v in d.items())  # noqa: E731
        return [
            f"round {self.round} ({self.split}): {self.samples} samples -> {self.out}  [{self.seconds:.1f}s]",
            f"episodes: {fmt(self.episodes)}",
            f"groups: {fmt(self.groups)}",
            f"turns: {fmt(self.turns)}",
            f"samples: {fmt(self.sample_counts)}",
            f"advantage: {self.advantage}",
        ]


def build_dataset(store: Store, *, round: int, out: Path, options: BuildOptions = BuildOptions()) -> BuildReport:
    """Write `out/samples.parquet` and `out/report.json` for the `options.split` episodes of `round`."""
    started = time.perf_counter()
    round = int(round)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = BuildReport(round=round, split=options.split, out=str(out), options=asdict(options))

    if options.rebuild:
        from lcap.dataset.rebuild import rebuild_missing_tokens

        rebuilt, unrebuildable = rebuild_missing_tokens(store, round=round, split=options.split, tokenizer=options.tokenizer)
    else:
        rebuilt = unrebuildable = 0

    parquet = out / "samples.parquet"
    keep = []
    if not options.keep_zero_variance:
        keep.append("NOT zero_variance")
    if options.drop_tampered:
        keep.append("NOT tampered")
    if options.truncated == "drop":
        keep.append("NOT truncated")
    elif options.truncated != "mask":
        raise LcapError(f"truncated must be 'drop' or 'mask', not {options.truncated!r}")
    env_mask = _MASKED_ENV if options.truncated == "mask" else "env_mask"
    params = {"round": round, "split": options.split}

    with store.connect() as con:
        # Evaluate the samples view once; the cleaning filters and the counts read this table.
        con.execute(
            """CREATE OR REPLACE TEMP TABLE _lcap_build AS
               SELECT * FROM samples_of($round, $split)""",
            params,
        )
        tmp = parquet.with_suffix(".parquet.tmp")
        # COPY takes no parameters; the filters are fixed SQL chosen above.
        con.execute(
            f"""COPY (SELECT {_SAMPLE_COLUMNS.format(env_mask=env_mask)} FROM _lcap_build
                      WHERE {' AND '.join(keep) or 'true'} ORDER BY group_id, episode_id, first_seq)
                TO '{_sql_path(tmp)}' (FORMAT parquet, ROW_GROUP_SIZE 16384)"""
        )
        tmp.replace(parquet)
        report.episodes = _one(con, _EPISODE_COUNTS, params)
        report.groups = _one(con, _GROUP_COUNTS, params)
        report.turns = _one(con, _TURN_COUNTS, params) | {"rebuilt_now": rebuilt, "unrebuildable": unrebuildable}
        report.sample_counts = _one(
            con,
            f"""SELECT count(*) AS built, count(*) FILTER (WHERE {' AND '.join(keep) or 'true'}) AS written,
                       count(*) FILTER (WHERE merged) AS merged, count(*) FILTER (WHERE NOT merged) AS single_call,
                       count(*) FILTER (WHERE zero_variance) AS zero_variance,
                       count(*) FILTER (WHERE truncated) AS truncated,
                       count(*) FILTER (WHERE truncated AND {'true' if options.truncated == 'mask' else 'false'})
                           AS truncated_masked,
                       count(*) FILTER (WHERE tampered) AS tampered,
                       count(*) FILTER (WHERE rebuilt) AS rebuilt,
                       count(DISTINCT episode_id) FILTER (WHERE sample_id NOT LIKE '%#0') AS episodes_split
                FROM _lcap_build""",
            {},
        )
        report.samples = report.sample_counts["written"]
        con.execute("DROP TABLE _lcap_build")
        report.seconds = round_(time.perf_counter() - started)
        con.execute(
            "INSERT INTO dataset_reports (round, split, out, report, created_at) VALUES (?, ?, ?, ?, ?)",
            [round, options.split, str(out), json.dumps(report.to_dict()), now()],
        )
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def round_(x: float) -> float:
    return float(f"{x:.3f}")


def _sql_path(path: Path) -> str:
    return str(path.resolve()).replace("'", "''")


def _one(con, sql: str, params: dict[str, Any]) -> dict[str, int]:
    cursor = con.execute(sql, params) if params else con.execute(sql)
    row = cursor.fetchone()
    return {d[0]: (int(v) if v is not None else 0) for d, v in zip(cursor.description, row)}


# Every episode of the round and split, by why it does or does not train.
_EPISODE_COUNTS = """
WITH e AS (SELECT * FROM episode_summary WHERE round = $round AND split = $split),
     a AS (SELECT * FROM episode_advantages WHERE round = $round AND split = $split)
SELECT (SELECT count(*) FROM e) AS total,
       (SELECT count(*) FILTER (WHERE status = 'failed') FROM e) AS failed,
       (SELECT count(*) FILTER (WHERE status = 'timeout') FROM e) AS timeout,
       (SELECT count(*) FILTER (WHERE status = 'error') FROM e) AS error,
       (SELECT count(*) FILTER (WHERE status NOT IN ('ok', 'failed', 'timeout', 'error') OR status IS NULL) FROM e)
           AS unfinished,
       (SELECT count(*) FILTER (WHERE status = 'ok' AND reward IS NULL) FROM e) AS no_reward,
       (SELECT count(*) FILTER (WHERE status = 'ok' AND reward IS NOT NULL) FROM e) - (SELECT count(*) FROM a)
           AS duplicate,
       (SELECT count(*) FILTER (WHERE list_contains(flags, 'tampered')) FROM e) AS tampered,
       (SELECT count(*) FILTER (WHERE zero_variance) FROM a) AS zero_variance,
       (SELECT count(*) FROM a WHERE episode_id NOT IN (SELECT episode_id FROM turn_tokens WHERE prompt_ids IS NOT NULL))
           AS no_usable_turns,
       (SELECT count(*) FROM a) AS rewarded
"""

_GROUP_COUNTS = """
SELECT count(*) AS total, count(*) FILTER (WHERE zero_variance) AS zero_variance,
       count(*) FILTER (WHERE group_size = 1) AS singleton, coalesce(max(group_size), 0) AS max_size
FROM (SELECT group_id, any_value(zero_variance) AS zero_variance, any_value(group_size) AS group_size
      FROM episode_advantages WHERE round = $round AND split = $split GROUP BY group_id)
"""

_TURN_COUNTS = """
WITH e AS (SELECT episode_id FROM episode_summary WHERE round = $round AND split = $split),
     t AS (SELECT * FROM turns WHERE episode_id IN (SELECT episode_id FROM e))
SELECT count(*) AS total, count(*) - count(DISTINCT turn_id) AS duplicate,
       count(*) FILTER (WHERE error IS NOT NULL OR status_code >= 400) AS failed_calls,
       count(*) FILTER (WHERE finish_reason = 'length') AS truncated,
       count(*) FILTER (WHERE token_source IS NULL OR prompt_token_ids IS NULL) AS without_token_ids
FROM t
"""
