"""Generate a synthetic lcap store of collect episodes, in SQL, for the build-dataset benchmark.

Each episode is a multi-turn conversation: turn k's prompt is turn k-1's prompt + completion +
environment tokens, as a chat template renders it, so the merge path is exercised; every
`split_every`-th episode rewrites its history after the first turn (like a template that strips
earlier reasoning), so the split path is exercised too. Groups of `group_size` samples per task,
rewards varying within groups, a few truncated completions.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lcap.store import Store


def make_store(
    path: Path,
    *,
    turns: int = 1_000_000,
    turns_per_episode: int = 4,
    group_size: int = 8,
    system_len: int = 48,
    completion_len: int = 24,
    env_len: int = 12,
    split_every: int = 10,
    round: int = 1,
) -> Store:
    episodes = turns // turns_per_episode
    path.unlink(missing_ok=True)
    store = Store(path)
    p = dict(
        E=episodes, K=turns_per_episode, G=group_size, S=system_len, C=completion_len, V=env_len, X=split_every, R=round
    )
    # Every value formatted into the SQL below is an int from this function's signature.
    sql = [
        "INSERT INTO deployments (name, path, base_model, kind, round, created_at) "
        "VALUES ('policy-r1', '/models/tiny', '/models/tiny', 'base', {R}, now())",
        """INSERT INTO episodes BY NAME
           SELECT 'ep' || e AS episode_id, 'python agent.py' AS command, '/tmp' AS cwd,
                  now() AS started_at, now() AS ended_at, 0 AS exit_code, 'ok' AS status,
                  json_object('task', 't' || (e // {G}), 'round', {R}, 'sample', e % {G}, 'split', 'train') AS labels,
                  't' || (e // {G}) AS task_id, {R} AS round, (e % {G})::INTEGER AS sample, 'train' AS split
           FROM range({E}) r(e)""",
        """INSERT INTO rewards BY NAME
           SELECT 'ep' || e AS episode_id, ((e * 7919) % 5) / 4.0 AS value, '{{}}' AS details,
                  'bench' AS source, now() AS created_at
           FROM range({E}) r(e)""",
        # Completion j of episode e and the environment tokens after it, as deterministic id lists.
        "CREATE TEMP MACRO comp(e, j) AS list_transform(range({C}), lambda x: ((e * 31 + j * 17 + x) % 30000 + 10)::INTEGER)",
        "CREATE TEMP MACRO envt(e, j) AS list_transform(range({V}), lambda x: ((e * 13 + j * 7 + x) % 30000 + 10)::INTEGER)",
        """INSERT INTO turns BY NAME
           SELECT 'tu' || e || '-' || k AS turn_id, 'ep' || e AS episode_id, k::INTEGER AS seq,
                  now() AS started_at, now() AS ended_at, 'chat' AS dialect, 200 AS status_code,
                  'policy-r1' AS deployment, 'vllm' AS token_source,
                  CASE WHEN (e * 3 + k) % 97 = 0 THEN 'length' ELSE 'stop' END AS finish_reason,
                  flatten(list_concat(
                      [list_transform(range({S}), lambda x: (CASE WHEN e % {X} = 0 AND k > 0 THEN x + 5 ELSE x END + 1)::INTEGER)],
                      list_transform(range(k), lambda j: list_concat(comp(e, j), envt(e, j))))) AS prompt_token_ids,
                  comp(e, k) AS completion_token_ids,
                  list_transform(range({C}), lambda x: -0.5 - x / 100.0) AS completion_logprobs
           FROM range({E}) r(e), range({K}) q(k)""",
    ]
    with store.connect() as con:
        for statement in sql:
            con.execute(statement.format(**p))
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path", type=Path)
    ap.add_argument("--turns", type=int, default=1_000_000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    make_store(args.path, turns=args.turns)
    print(f"{args.turns} turns -> {args.path} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
