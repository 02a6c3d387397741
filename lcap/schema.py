"""The store's schema: every table and view that lcap's stages share, in one place.

Tables are append-mostly. Rows are written in batches (see `Store.append`), never one INSERT per
request. Views carry the joins, so `lcap sql` and the stages read the same definitions.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import duckdb
from duckdb.sqltypes import VARCHAR

from lcap.redact import redact_labels, redact_text

# Episode labels that are also columns (for joins and filters): label -> (column, SQL type).
PROMOTED_LABELS = {
    "task": ("task_id", "VARCHAR"),
    "round": ("round", "INTEGER"),
    "sample": ("sample", "INTEGER"),
    "split": ("split", "VARCHAR"),
}

# The store's shape. A new store gets TABLES at SCHEMA_VERSION; an older one is brought there by MIGRATIONS
# (version reached -> statements, or functions of the connection), in order, inside the unit of work that first
# opens it for writing.
SCHEMA_VERSION = 15


def _redact_labels_json(labels: str) -> str:
    value = json.loads(labels)
    return json.dumps(redact_labels(value)) if isinstance(value, dict) else labels


def redact_episodes(con: duckdb.DuckDBPyConnection) -> None:
    """What came from the user's invocation, stored in clear before version 10: the episodes' commands, cwds,
    labels (and the columns promoted from them) and errors, redacted as `Store.start_episode` now does."""
    functions = {"lcap_redact_text": redact_text, "lcap_redact_labels": _redact_labels_json}
    for name, function in functions.items():
        con.create_function(name, function, [VARCHAR], VARCHAR, side_effects=False)
    try:
        con.execute(
            """UPDATE episodes SET command = lcap_redact_text(command), cwd = lcap_redact_text(cwd),
                      error = lcap_redact_text(error), labels = lcap_redact_labels(labels),
                      task_id = lcap_redact_text(task_id), split = lcap_redact_text(split)"""
        )
    finally:
        for name in functions:
            con.remove_function(name)


JUDGE_CACHE = """
CREATE TABLE IF NOT EXISTS judge_cache (
    rubric_hash     VARCHAR,   -- sha256 of the rubric's text
    judge_model     VARCHAR,
    transcript_hash VARCHAR,   -- sha256 of what the judge was shown of the episode (a group's: of the whole group)
    mode            VARCHAR,   -- pointwise | group
    episode_id      VARCHAR,   -- the episode first judged with this key
    score           DOUBLE,
    details         JSON,      -- reasons, the judge episode
    created_at      TIMESTAMPTZ
)"""

MIGRATIONS: dict[int, tuple[str | Callable[[duckdb.DuckDBPyConnection], None], ...]] = {
    2: (
        "ALTER TABLE episodes RENAME COLUMN group_index TO sample",
        "ALTER TABLE episodes ADD COLUMN split VARCHAR",
        "UPDATE episodes SET split = labels->>'split'",
    ),
    3: ("ALTER TABLE turns ADD COLUMN IF NOT EXISTS degraded VARCHAR",),  # a version 1 store may have no turns
    4: (
        "ALTER TABLE train_runs ADD COLUMN IF NOT EXISTS mismatch_kl DOUBLE",
        "ALTER TABLE train_runs ADD COLUMN IF NOT EXISTS mismatch_logp_diff DOUBLE",
        "ALTER TABLE train_runs ADD COLUMN IF NOT EXISTS mismatch_seconds DOUBLE",
        "ALTER TABLE train_runs ADD COLUMN IF NOT EXISTS mismatch JSON",
    ),
    5: ("ALTER TABLE turns ADD COLUMN IF NOT EXISTS replica VARCHAR",),
    6: tuple(
        f"ALTER TABLE turns ADD COLUMN IF NOT EXISTS {column}"
        for column in (
            "stitched BOOLEAN",
            "stitched_from VARCHAR",
            "thread_seq INTEGER",
            "stitch_note VARCHAR",
            "adaptations JSON",
        )
    ),
    7: ("ALTER TABLE train_runs ADD COLUMN IF NOT EXISTS mismatch_held VARCHAR",),
    8: ("ALTER TABLE rewards ADD COLUMN IF NOT EXISTS key VARCHAR",),
    9: ("ALTER TABLE deployments ADD COLUMN IF NOT EXISTS rollback_of VARCHAR",),
    10: (redact_episodes,),
    11: (JUDGE_CACHE,),
    12: ("ALTER TABLE turns ADD COLUMN IF NOT EXISTS role VARCHAR",),  # turns captured before it: NULL
    13: ("ALTER TABLE deployments ADD COLUMN IF NOT EXISTS role VARCHAR",),  # deployments before it: NULL, default's
    14: ("ALTER TABLE train_runs ADD COLUMN IF NOT EXISTS dropped_alone INTEGER",),  # rounds before it: NULL
    15: ("ALTER TABLE train_runs ADD COLUMN IF NOT EXISTS step_kl DOUBLE",),  # rounds before it: NULL
}

TABLES = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER);

CREATE TABLE IF NOT EXISTS episodes (
    episode_id     VARCHAR PRIMARY KEY,
    command        VARCHAR,
    cwd            VARCHAR,
    started_at     TIMESTAMPTZ,
    ended_at       TIMESTAMPTZ,
    exit_code      INTEGER,
    status         VARCHAR,   -- running | ok | failed | timeout | interrupted | error
    error          VARCHAR,
    labels         JSON,      -- every --label key=value, e.g. {"task": "17", "round": "2"}
    task_id        VARCHAR,   -- labels.task, promoted for joins (PROMOTED_LABELS)
    round          INTEGER,   -- labels.round
    sample         INTEGER,   -- labels.sample: which member of its GRPO group
    split          VARCHAR    -- labels.split: train | eval
);

CREATE TABLE IF NOT EXISTS turns (
    turn_id              VARCHAR,
    episode_id           VARCHAR,   -- NULL when a --serve client named no episode
    seq                  INTEGER,   -- order of the call within its episode (at request time)
    started_at           TIMESTAMPTZ,
    ended_at             TIMESTAMPTZ,
    latency_ms           DOUBLE,
    ttft_ms              DOUBLE,    -- first response byte (streams: first chunk)
    host                 VARCHAR,   -- the host the agent called
    path                 VARCHAR,   -- without query string secrets
    dialect              VARCHAR,   -- chat | completions | responses | messages
    transport            VARCHAR,   -- http | websocket
    stream               BOOLEAN,
    upstream             VARCHAR,   -- where the call was actually sent
    model_requested      VARCHAR,
    model_served         VARCHAR,
    deployment           VARCHAR,   -- the policy deployment that served it (see deployments)
    request              JSON,      -- the request body as sent by the agent, secrets removed
    response             JSON,      -- the answer, streams reassembled into the non-streaming shape
    status_code          INTEGER,
    error                VARCHAR,
    finish_reason        VARCHAR,
    completion_text      VARCHAR,   -- raw text of the completion, before any tool parsing
    tool_calls           JSON,
    reasoning            VARCHAR,
    prompt_tokens        INTEGER,
    completion_tokens    INTEGER,
    prompt_token_ids     INTEGER[],
    completion_token_ids INTEGER[],
    completion_logprobs  DOUBLE[],
    token_source         VARCHAR,   -- 'vllm' when ids/logprobs came from the server, else NULL
    degraded             VARCHAR,   -- NULL, or why this row is not the turn exactly as captured (see dead_letters)
    replica              VARCHAR,   -- the policy replica lcap routed the call to (r0, r1, ...); NULL when not the policy
    stitched             BOOLEAN,   -- lcap's policy endpoints served it: its prompt is stitched_from's exact ids +
                                    -- completion + the rendered suffix (true), or rendered (false); NULL elsewhere
    stitched_from        VARCHAR,   -- the turn_id whose prompt and completion this prompt starts with
    thread_seq           INTEGER,   -- seq of the first turn of its chain of stitched turns (its own seq if none)
    stitch_note          VARCHAR,   -- why a turn offered a previous one was not stitched onto it
    adaptations          JSON,      -- what was changed in the request and why: [{field, action, from, to, why}]
    role                 VARCHAR    -- which of the agent's jobs made the call: its X-Lcap-Role header, a --role-by
                                    -- rule's, or 'default' (NULL: captured before roles)
);

-- capture: spooled records the writer could not store as they were, kept whole (one row per record)
CREATE TABLE IF NOT EXISTS dead_letters (
    record_id   VARCHAR,      -- SPOOL/SEGMENT/OFFSET: where the record was spooled
    turn_id     VARCHAR,      -- NULL when the record could not even be read
    episode_id  VARCHAR,
    stored_as   VARCHAR,      -- degraded (in turns, text repaired) | skeleton (in turns, without content) | none
    reason      VARCHAR,
    record      BLOB,         -- the record exactly as spooled, sealed with LCAP_HOME/spool/key
    created_at  TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS rewards (
    episode_id  VARCHAR,
    value       DOUBLE,
    details     JSON,
    source      VARCHAR,   -- verifier command, module:function, 'cli', or what a poster to the reward endpoint said
    created_at  TIMESTAMPTZ,
    key         VARCHAR    -- the poster's idempotency key: a second reward with the same key is not stored
);

CREATE TABLE IF NOT EXISTS deployments (
    name        VARCHAR,   -- the name vLLM serves it under; requests are routed to it
    path        VARCHAR,
    base_model  VARCHAR,
    kind        VARCHAR,   -- base | lora | full | default (a role rolled back onto the default role's deployment)
    round       INTEGER,
    created_at  TIMESTAMPTZ,
    rollback_of VARCHAR,   -- `lcap deploy --rollback`: the deployment this row took out of service (NULL: none)
    role        VARCHAR    -- the role it was deployed for (lcap/policy.py; NULL: before roles, the default role)
);

-- dataset stage: flags raised on episodes (tampered, verifier_error, ...), one row per flag
CREATE TABLE IF NOT EXISTS episode_flags (
    episode_id  VARCHAR,
    flag        VARCHAR,
    details     JSON,
    created_at  TIMESTAMPTZ
);

-- dataset stage: token ids re-tokenised from the chat template for turns captured without ids
CREATE TABLE IF NOT EXISTS rebuilt_turns (
    turn_id              VARCHAR,
    prompt_token_ids     INTEGER[],
    completion_token_ids INTEGER[],
    tokenizer            VARCHAR,
    created_at           TIMESTAMPTZ
);

-- train stage: one row per GRPO round (`lcap train`), metrics averaged over its steps
CREATE TABLE IF NOT EXISTS train_runs (
    run            VARCHAR,   -- the run folder (absolute)
    round          INTEGER,
    started_at     TIMESTAMPTZ,
    ended_at       TIMESTAMPTZ,
    base_model     VARCHAR,
    init_from      VARCHAR,   -- the previous round's adapter/checkpoint it continued, NULL for round 1
    output         VARCHAR,   -- RUN/round-N/adapter or RUN/round-N/checkpoint
    kind           VARCHAR,   -- lora | full
    n_samples      INTEGER,
    n_groups       INTEGER,
    group_size     INTEGER,
    dropped_stale  INTEGER,
    padded         INTEGER,
    mean_reward    DOUBLE,
    loss           DOUBLE,
    kl             DOUBLE,
    is_ratio_mean  DOUBLE,    -- importance-sampling ratio vs the captured behaviour logprobs
    is_ratio_min   DOUBLE,
    is_ratio_max   DOUBLE,
    clip_fraction  DOUBLE,
    entropy        DOUBLE,
    tokens         BIGINT,
    train_seconds  DOUBLE,
    tokens_per_s   DOUBLE,
    steps          INTEGER,
    config         JSON,
    -- the mismatch guard (lcap.train.mismatch), before the first step: the trainer's log-probs of the captured
    -- tokens against vLLM's, for the held deployment that differs most (every deployment's figures in `mismatch`)
    mismatch_kl         DOUBLE,   -- k3 estimate of KL(served || trained) per model token
    mismatch_logp_diff  DOUBLE,   -- mean |train logp - served logp|
    mismatch_seconds    DOUBLE,   -- the guard's no-grad forward
    mismatch            JSON,     -- [{deployment, samples, tokens, logp_diff, kl}]
    -- the one deployment held to the limit (an async step's: the one being trained), NULL: all of them; with
    -- mismatch_kl NULL and samples scored, the batch had none of its samples and the guard checked nothing
    mismatch_held       VARCHAR,
    dropped_alone       INTEGER,   -- samples left out, alone in their group: GRPO had nothing to compare them with
    -- the same measure after training, with the trained weights: how far the round moved the policy from the
    -- deployment that served its samples (`lcap loop --max-step-kl` deploys no round that moved further)
    step_kl             DOUBLE
);

-- train stage: `lcap loop` progress, one row per finished step of a round (collect, build, train, deploy, eval)
CREATE TABLE IF NOT EXISTS loop_steps (
    run          VARCHAR,
    round        INTEGER,
    step         VARCHAR,
    mean_reward  DOUBLE,      -- collect: training episodes' mean reward; eval: held-out mean reward
    details      JSON,
    created_at   TIMESTAMPTZ
);

-- train stage: `lcap loop --async`, one row per training step (a batch of complete groups), when it is deployed
CREATE TABLE IF NOT EXISTS async_steps (
    run             VARCHAR,
    step            INTEGER,      -- the step; its output is deployment version `step`
    groups          INTEGER,      -- complete groups in the batch
    queue           INTEGER,      -- complete groups not yet trained when the batch was taken (the batch's included)
    samples         INTEGER,      -- samples trained on
    dropped_stale   INTEGER,      -- samples past --max-staleness (or from a deployment the loop does not know)
    staleness       JSON,         -- {staleness: samples} over the batch's samples, before the drop ("unknown" too)
    trainer_wait_s  DOUBLE,       -- the trainer waited this long for the batch's groups to complete
    agent_wait_s    DOUBLE,       -- idle episode slots since the previous step, slot-seconds / --concurrency
    in_flight       INTEGER,      -- episodes running when the step was deployed
    deployed        VARCHAR,
    seconds         DOUBLE,       -- the step's wall time, from the previous step's deploy
    created_at      TIMESTAMPTZ
);

-- dataset stage: one row per `lcap build-dataset`, the cleaning counts as JSON
CREATE TABLE IF NOT EXISTS dataset_reports (
    round       INTEGER,
    split       VARCHAR,
    out         VARCHAR,
    report      JSON,
    created_at  TIMESTAMPTZ
);
"""
# dataset stage: an LLM judge's verdicts by (rubric, model, what it was shown): a second judging is free
TABLES += JUDGE_CACHE + ";\n"

# How each dialect says a completion was cut by the token limit: chat/completions 'length',
# Messages 'max_tokens', Responses 'max_output_tokens'. SQL asks `cut_by_token_limit(finish_reason)`.
TRUNCATED_REASONS = ("length", "max_tokens", "max_output_tokens")

# The baselines `advantages_by` knows (`build-dataset --advantage`), and how many episodes the batch ones put in
# one of the trainer's groups (TRL lays a batch out in groups; the advantage stays the batch's).
ADVANTAGE_METHODS = ("group", "batch", "rloo")
BATCH_LAYOUT = 8

VIEWS = f"""
CREATE OR REPLACE MACRO cut_by_token_limit(reason) AS
    coalesce(reason IN ({", ".join(f"'{r}'" for r in TRUNCATED_REASONS)}), false);
-- a call's role (turns.role); a call captured before roles was the agent's one role, `default`
CREATE OR REPLACE MACRO turn_role(role) AS coalesce(role, 'default');
""" + """
-- each episode's latest reward from one source (`lcap rescore --source`, a verifier, 'cli', ...; NULL: any source)
CREATE OR REPLACE MACRO rewards_from(source_) AS TABLE
    SELECT episode_id, arg_max(value, created_at) AS reward,
           arg_max(details, created_at) AS details, arg_max(source, created_at) AS source
    FROM rewards WHERE source_ IS NULL OR source = source_ GROUP BY episode_id;
CREATE OR REPLACE VIEW latest_rewards AS SELECT * FROM rewards_from(NULL::VARCHAR);
-- every reward with how late it came: seconds after its episode ended (its last turn, for an episode never ended)
CREATE OR REPLACE VIEW reward_delays AS
    WITH last_turn AS (SELECT episode_id, max(ended_at) AS ended_at FROM turns GROUP BY episode_id)
    SELECT r.episode_id, r.value, r.source, r.key, r.details, r.created_at,
           coalesce(e.ended_at, t.ended_at) AS episode_ended_at,
           epoch(r.created_at) - epoch(coalesce(e.ended_at, t.ended_at)) AS late_s
    FROM rewards r LEFT JOIN episodes e USING (episode_id) LEFT JOIN last_turn t USING (episode_id);
-- dataset stage views. A collect episode is keyed by (round, split, task_id, sample); its GRPO
-- group is every sample of one task in one round and split.
CREATE OR REPLACE VIEW episode_summary AS
    WITH t AS (
        SELECT episode_id, count(*) AS n_turns,
               sum(coalesce(prompt_tokens, len(prompt_token_ids))) AS prompt_tokens,
               sum(coalesce(completion_tokens, len(completion_token_ids))) AS completion_tokens,
               count(*) FILTER (WHERE error IS NOT NULL OR status_code >= 400) AS failed_calls
        FROM turns WHERE episode_id IS NOT NULL GROUP BY episode_id),
    f AS (SELECT episode_id, list(DISTINCT flag ORDER BY flag) AS flags FROM episode_flags GROUP BY episode_id)
    SELECT e.episode_id, e.task_id, e.round, coalesce(e.split, 'train') AS split, e.sample,
           concat_ws('/', e.round, coalesce(e.split, 'train'), e.task_id) AS group_id,
           e.status, e.error, e.exit_code,
           coalesce(t.n_turns, 0) AS n_turns, coalesce(t.prompt_tokens, 0) AS prompt_tokens,
           coalesce(t.completion_tokens, 0) AS completion_tokens, coalesce(t.failed_calls, 0) AS failed_calls,
           r.reward, r.source AS reward_source, r.details AS reward_details,
           coalesce(f.flags, []::VARCHAR[]) AS flags,
           e.started_at, e.ended_at, epoch(e.ended_at) - epoch(e.started_at) AS duration_s,
           e.labels->>'collect' AS collect_run, e.command
    FROM episodes e LEFT JOIN t USING (episode_id) LEFT JOIN latest_rewards r USING (episode_id)
    LEFT JOIN f USING (episode_id);

-- Episodes that can train, one per key (the latest), with their baseline's statistics and advantage.
-- `advantages_by(ids, method, source_)`: over the episodes `ids` only (NULL: all), so that a selection
-- (`build-dataset --where`) is the population its groups and advantages come from; the reward is each
-- episode's latest from `source_` (NULL: any source). An episode can train when it is rewarded and finished ok,
-- or is a session of a serving proxy (labels.attributed_by; it never ends, its reward is its verdict) that is
-- still running. `method` (`build-dataset --advantage`) names the baseline:
--   group  GRPO (Shao et al. 2024, arXiv 2402.03300), as TRL computes it: (reward - group mean) /
--          (group sample std + 1e-4) over one task's samples of one round and split; an episode needs a task
--          and a round (its key: round, split, task, sample).
--   batch  REINFORCE++'s global normalisation (Hu 2025, arXiv 2501.03262): (reward - batch mean) /
--          (batch sample std + 1e-4) over every chosen episode of the split, tasks or none.
--   rloo   RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740) over the batch: reward minus the mean
--          of the split's other chosen episodes, unscaled; 0 for a batch of one.
-- An episode without a task or a round (live traffic) is its own key. Under batch and rloo the baseline's
-- population is the split; group_id then lays the batch out for the trainer in groups of about
-- BATCH_LAYOUT episodes (the advantage is the batch's, not the layout group's).
CREATE OR REPLACE MACRO advantages_by(ids, method, source_) AS TABLE
    WITH r AS (SELECT episode_id, reward FROM rewards_from(source_)),
    s AS (
        SELECT s.* EXCLUDE (reward), r.reward, e.labels->>'attributed_by' AS attributed_by
        FROM episode_summary s JOIN episodes e USING (episode_id) LEFT JOIN r USING (episode_id)),
    eligible AS (
        SELECT *, row_number() OVER (
                   PARTITION BY round, split, task_id, sample,
                                CASE WHEN round IS NULL OR task_id IS NULL THEN episode_id END
                   ORDER BY started_at DESC) AS key_rank,
               CASE WHEN method = 'group' THEN group_id ELSE split END AS baseline
        FROM s
        WHERE reward IS NOT NULL AND (status = 'ok' OR (status = 'running' AND attributed_by IS NOT NULL))
          AND (method <> 'group' OR (round IS NOT NULL AND task_id IS NOT NULL))
          AND (ids IS NULL OR episode_id IN (SELECT unnest(ids)))),
    kept AS (
        SELECT *, count(*) OVER g AS n, avg(reward) OVER g AS mean, coalesce(stddev_samp(reward) OVER g, 0) AS std,
               row_number() OVER (PARTITION BY baseline ORDER BY episode_id) - 1 AS position
        FROM eligible WHERE key_rank = 1 WINDOW g AS (PARTITION BY baseline))
    SELECT episode_id, task_id, round, split, sample,
           CASE WHEN method = 'group' THEN group_id
                ELSE concat_ws('/', split, 'batch', position % greatest(n // BATCH_LAYOUT, 1)) END AS group_id,
           reward, list_contains(flags, 'tampered') AS tampered, status,
           n AS group_size, mean AS group_mean, std AS group_std,
           CASE WHEN method = 'rloo' THEN CASE WHEN n > 1 THEN reward - (mean * n - reward) / (n - 1) ELSE 0 END
                ELSE (reward - mean) / (std + 1e-4) END AS advantage,
           max(reward) OVER (PARTITION BY baseline) = min(reward) OVER (PARTITION BY baseline) AS zero_variance
    FROM kept;
CREATE OR REPLACE MACRO advantages_over(ids) AS TABLE SELECT * FROM advantages_by(ids, 'group', NULL::VARCHAR);
CREATE OR REPLACE VIEW episode_advantages AS SELECT * FROM advantages_over(NULL::VARCHAR[]);

-- What `build-dataset --where` and `lcap export --where` select from: one row per episode, with what its
-- turns say (the model and deployment that answered most of its calls, and every one) and its age.
CREATE OR REPLACE VIEW episode_selection AS
    WITH t AS (
        SELECT episode_id,
               mode(coalesce(model_served, model_requested)) AS model,
               list(DISTINCT coalesce(model_served, model_requested))
                   FILTER (WHERE coalesce(model_served, model_requested) IS NOT NULL) AS models,
               mode(deployment) AS deployment,
               list(DISTINCT deployment) FILTER (WHERE deployment IS NOT NULL) AS deployments,
               list(DISTINCT turn_role(role) ORDER BY turn_role(role)) AS roles
        FROM turns WHERE episode_id IS NOT NULL GROUP BY episode_id)
    SELECT s.episode_id, s.task_id, s.round, s.split, s.sample, s.group_id, s.collect_run AS run, e.labels,
           s.status, s.reward, s.reward_source, s.flags, s.n_turns, t.model, coalesce(t.models, []) AS models,
           t.deployment, coalesce(t.deployments, []) AS deployments, coalesce(t.roles, []) AS roles,
           s.started_at, s.ended_at,
           now() - coalesce(s.ended_at, s.started_at) AS age
    FROM episode_summary s JOIN episodes e USING (episode_id) LEFT JOIN t USING (episode_id);

-- Every successful LLM call of an episode with its token ids: captured ones, else the ids
-- re-tokenised from the chat template (rebuilt). One row per turn_id even if it was logged twice.
CREATE OR REPLACE VIEW turn_tokens AS
    WITH dup AS (  -- later copies of a turn_id (narrow: the dedup never moves token lists)
        SELECT rowid AS rid FROM turns
        WHERE turn_id IN (SELECT turn_id FROM turns GROUP BY turn_id HAVING count(*) > 1)
        QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY rowid) > 1),
    t AS (
        SELECT * FROM turns
        WHERE episode_id IS NOT NULL AND error IS NULL AND coalesce(status_code, 200) < 400
          AND rowid NOT IN (SELECT rid FROM dup)),
    rb AS (SELECT * FROM rebuilt_turns QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at DESC) = 1),
    j AS (
        SELECT t.turn_id, t.episode_id, t.seq, coalesce(t.thread_seq, t.seq) AS thread, t.deployment, t.finish_reason,
               t.token_source IS NULL OR t.prompt_token_ids IS NULL OR t.completion_token_ids IS NULL AS rebuilt,
               t.prompt_token_ids AS cap_prompt, t.completion_token_ids AS cap_completion,
               t.completion_logprobs AS cap_logprobs,
               rb.prompt_token_ids AS rb_prompt, rb.completion_token_ids AS rb_completion
        FROM t LEFT JOIN rb USING (turn_id))
    SELECT turn_id, episode_id, seq, thread, deployment, finish_reason, rebuilt,
           cut_by_token_limit(finish_reason) AS truncated,
           CASE WHEN rebuilt THEN rb_prompt ELSE cap_prompt END AS prompt_ids,
           CASE WHEN rebuilt THEN rb_completion ELSE cap_completion END AS completion_ids,
           CASE WHEN rebuilt OR cap_logprobs IS NULL
                THEN list_transform(CASE WHEN rebuilt THEN rb_completion ELSE cap_completion END, lambda x: 0.0)
                ELSE cap_logprobs END AS logprobs
    FROM j;
""".replace("BATCH_LAYOUT", str(BATCH_LAYOUT))

# Training samples (dataset stage). Consecutive calls of an episode merge into one sequence when
# the next prompt's token ids start with the previous prompt + completion (checked on ids, never
# assumed: templates may rewrite history), the same deployment served both and the previous
# completion was not truncated; the tokens in between are environment tokens (env_mask 0,
# logprob 0). Otherwise a call starts a new sample, so a truncated call always ends its sample.
# "Consecutive" is in (thread, seq) order: a stitched call follows the call it was stitched onto
# even when other calls of the episode (a sub-agent, a title request) came in between.
# `turn_segments(round, split)` (NULL: all) gives, per call, the sample it belongs to and its
# segment: env tokens + completion; the view `samples` concatenates them in seq order. The rule
# lcap applies is lcap.dataset.build.merge (build-dataset, `lcap export`, the UI's token view: vectorised on
# the Arrow buffers of the joined turns); this is its SQL statement, for inspection in `lcap sql`, which
# tests/unit/test_dataset_build.py holds equal to it.
_SEGMENTS = """
    WITH tt AS (
        SELECT tt.episode_id, tt.seq, tt.thread, tt.prompt_ids, tt.completion_ids, tt.logprobs, tt.truncated,
               tt.deployment, tt.rebuilt,
               lag(tt.prompt_ids) OVER w AS prev_prompt, lag(tt.completion_ids) OVER w AS prev_completion,
               lag(tt.truncated) OVER w AS prev_truncated, lag(tt.deployment) OVER w AS prev_deployment
        FROM turn_tokens tt
        SEMI JOIN (SELECT episode_id FROM episode_advantages
                   WHERE (round_ IS NULL OR round = round_) AND (split_ IS NULL OR split = split_)) a USING (episode_id)
        WHERE tt.prompt_ids IS NOT NULL AND tt.completion_ids IS NOT NULL
        WINDOW w AS (PARTITION BY tt.episode_id ORDER BY tt.thread, tt.seq)),
    m AS (
        SELECT episode_id, seq, thread, truncated, deployment, rebuilt, completion_ids, logprobs,
               coalesce(prev_prompt IS NOT NULL AND NOT prev_truncated
                        AND deployment IS NOT DISTINCT FROM prev_deployment
                        AND len(prompt_ids) >= len(prev_prompt) + len(prev_completion)
                        AND list_slice(prompt_ids, 1, len(prev_prompt) + len(prev_completion))
                            = list_concat(prev_prompt, prev_completion), false) AS extends,
               CASE WHEN extends THEN list_slice(prompt_ids, len(prev_prompt) + len(prev_completion) + 1, len(prompt_ids))
                    ELSE []::INTEGER[] END AS env_ids,
               CASE WHEN extends THEN NULL ELSE prompt_ids END AS prompt_ids
        FROM tt),
    p AS (
        SELECT *, sum(CASE WHEN extends THEN 0 ELSE 1 END) OVER (PARTITION BY episode_id ORDER BY thread, seq
                      ROWS UNBOUNDED PRECEDING) - 1 AS part
        FROM m)
    SELECT p.episode_id || '#' || p.part AS sample_id, p.episode_id, p.seq, p.part, p.extends,
           a.task_id, a.round, a.split, a.group_id, a.reward, a.advantage, a.zero_variance, a.tampered,
           p.deployment, p.rebuilt, p.truncated, p.prompt_ids,
           list_concat(p.env_ids, p.completion_ids) AS seg_ids,
           list_concat(list_transform(p.env_ids, lambda x: 0.0), p.logprobs) AS seg_logprobs,
           list_concat(list_transform(p.env_ids, lambda x: 0), list_transform(p.completion_ids, lambda x: 1)) AS seg_mask,
           len(p.completion_ids) AS completion_len
    FROM p JOIN episode_advantages a USING (episode_id)
"""

VIEWS += f"""
CREATE OR REPLACE MACRO turn_segments(round_, split_) AS TABLE {_SEGMENTS};
CREATE OR REPLACE VIEW samples AS
    SELECT sample_id, any_value(episode_id) AS episode_id, any_value(task_id) AS task_id,
           any_value(round) AS round, any_value(split) AS split, any_value(group_id) AS group_id,
           arg_min(prompt_ids, seq) AS prompt_ids,
           flatten(list(seg_ids ORDER BY seq)) AS completion_ids,
           flatten(list(seg_logprobs ORDER BY seq)) AS logprobs,
           flatten(list(seg_mask ORDER BY seq)) AS env_mask,
           any_value(reward) AS reward, any_value(advantage) AS advantage,
           arg_min(deployment, seq) AS deployment, bool_or(rebuilt) AS rebuilt,
           bool_or(truncated) AS truncated, count(*)::INTEGER AS n_turns, count(*) > 1 AS merged,
           any_value(zero_variance) AS zero_variance, any_value(tampered) AS tampered
    FROM turn_segments(NULL, NULL) GROUP BY sample_id;
"""
