"""The store's schema: every table and view that lcap's stages share, in one place.

Tables are append-mostly. Rows are written in batches (see `Store.append`), never one INSERT per
request. Views carry the joins, so `lcap sql` and the stages read the same definitions.
"""

TABLES = """
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
    task_id        VARCHAR,   -- labels.task, promoted for joins
    round          INTEGER,   -- labels.round
    group_index    INTEGER    -- labels.sample: which member of its GRPO group
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
    token_source         VARCHAR    -- 'vllm' when ids/logprobs came from the server, else NULL
);

CREATE TABLE IF NOT EXISTS rewards (
    episode_id  VARCHAR,
    value       DOUBLE,
    details     JSON,
    source      VARCHAR,   -- verifier command, module:function, or 'cli'
    created_at  TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS deployments (
    name        VARCHAR,   -- the name vLLM serves it under; requests are routed to it
    path        VARCHAR,
    base_model  VARCHAR,
    kind        VARCHAR,   -- base | lora | full
    round       INTEGER,
    created_at  TIMESTAMPTZ
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
    config         JSON
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
"""

VIEWS = """
CREATE OR REPLACE VIEW latest_rewards AS
    SELECT episode_id, arg_max(value, created_at) AS reward,
           arg_max(details, created_at) AS details, arg_max(source, created_at) AS source
    FROM rewards GROUP BY episode_id;
"""
