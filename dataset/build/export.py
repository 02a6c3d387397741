"""`lcap export`: chosen episodes as the files other trainers read.

One conversation per episode and role (an agent whose jobs call as roles, `turns.role`, has a conversation for
each, the role's first call first): the messages of the role's call whose prompt holds the most messages, and that
call's answer (from the parsed columns capture fills for every dialect: text, tool calls, reasoning). Chat calls are
read as they are, Anthropic Messages and Responses calls as build-dataset's re-rendering reads them
(`chat_from_anthropic`, `chat_from_responses`: text, tool calls and their results); a Responses call whose request
does not hold its conversation (it continues another by `previous_response_id`) and legacy completions calls (a
prompt string with no roles: a conversation would have to be invented) are skipped and counted. Formats:

- `openai`: OpenAI's chat fine-tuning JSONL, one `{"messages", "tools"}` object a line.
- `hf`: a Hugging Face dataset folder that both `datasets.load_dataset(PATH)` (`data/train-00000-of-00001.parquet`)
  and `datasets.load_from_disk(PATH)` (`dataset_dict.json` and `train/`, the layout `save_to_disk` writes: the same
  rows again as an Arrow stream) open, a `train` split either way: messages, tools, the episode's labels (JSON
  text), reward and role, and its token ids with the loss mask where the role's calls were captured with ids and
  stitch into one sample (build-dataset's merge, `merge.py`), with a task or without (an `lcap proxy` episode).
- `verl`: `sft.parquet` (verl's multi-turn SFT data: `messages`, `tools`, a row per conversation) and `rl.parquet`
  (verl's RL prompt data, one row a task, from its first episode's first conversation: `data_source`, `prompt`,
  `ability`, `reward_model`, `extra_info`).

The selection, the joins and the choice of each episode's call are SQL over the store's views; Python shapes
each chosen call's JSON into messages. Nothing holds the whole selection: the rows come from DuckDB in batches of
`BATCH_ROWS`, each written as it comes (a JSONL line, a Parquet row group) under a temporary name that replaces the
file at the end; verl's task prompts are a second pass over each task's first episode. Every record goes through the redaction the store's writer applies
(`redact_json`, then `redact_keys` over the text), so no secret leaves, whatever wrote the store.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import secrets
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lcap.config import LcapError
from lcap.dataset.build.export_schema import (
    HF_DATA_FILE,
    HF_DISK_FILE,
    HF_DISK_SPLIT,
    HF_SCHEMA,
    VERL_DATA_SOURCE,
    VERL_RL_FILE,
    VERL_RL_SCHEMA,
    VERL_SFT_FILE,
    VERL_SFT_SCHEMA,
)
from lcap.dataset.build.merge import merge_turns
from lcap.dataset.build.rebuild import chat_from_anthropic, chat_from_responses
from lcap.dataset.build.select import select_episodes
from lcap.files import atomic_write, replacing
from lcap.progress import Reporter
from lcap.redact import redact_json, redact_keys
from lcap.store import Store

FORMATS = ("openai", "hf", "verl")
_DIALECTS = ("chat", "messages", "responses")  # OpenAI chat completions, Anthropic Messages, Responses (read as chat)
BATCH_ROWS = 256  # episodes fetched from DuckDB at once, and rows per Parquet row group

# The episodes chosen, oldest first, each role of each (in the order of their first calls) with the turn of its
# conversation's call (successful, a dialect export reads preferred: the call whose request holds the most messages,
# the latest of equals) and that call's `rank` among the episode's chosen calls by the same order (1: the call one
# conversation of the whole episode would be). An episode with no successful call is one row, its role NULL. Keys
# only: sorting the calls' text would hold the whole selection in DuckDB's memory.
_EPISODES = """
WITH chosen AS (
    SELECT * FROM episode_selection
    WHERE $episodes::VARCHAR[] IS NULL OR episode_id IN (SELECT unnest($episodes::VARCHAR[]))),
ranked AS (
    SELECT t.episode_id, turn_role(t.role) AS role, t.turn_id, t.seq,
           t.dialect IN ('chat', 'messages', 'responses') AS readable,
           coalesce(json_array_length(t.request->'messages'), json_array_length(t.request->'input'), 0) AS n_messages
    FROM turns t SEMI JOIN chosen USING (episode_id)
    WHERE t.error IS NULL AND coalesce(t.status_code, 200) < 400 AND t.request IS NOT NULL),
call AS (
    SELECT episode_id, role, turn_id, min(seq) OVER (PARTITION BY episode_id, role) AS first_seq
    FROM ranked
    QUALIFY row_number() OVER (PARTITION BY episode_id, role ORDER BY readable DESC, n_messages DESC, seq DESC) = 1),
best AS (
    SELECT turn_id, row_number() OVER (
        PARTITION BY episode_id ORDER BY readable DESC, n_messages DESC, seq DESC) AS rank
    FROM ranked SEMI JOIN call USING (turn_id))
SELECT c.episode_id, c.task_id, c.round, c.split, c.run, c.model, c.deployment, c.reward, c.reward_source,
       c.labels::VARCHAR AS labels, call.role, call.turn_id, best.rank
FROM chosen c LEFT JOIN call USING (episode_id) LEFT JOIN best USING (turn_id)
ORDER BY c.started_at, c.episode_id, call.first_seq
"""
# A batch of those calls, with their text.
_CALLS = """
SELECT turn_id, dialect, request::VARCHAR AS request, completion_text, tool_calls::VARCHAR AS tool_calls, reasoning,
       cut_by_token_limit(finish_reason) AS truncated
FROM turns WHERE turn_id IN (SELECT unnest($turns::VARCHAR[]))
"""
# What a re-scoring verifier is told of each episode besides its conversation.
_STATUS_AND_LABELS = """
SELECT s.episode_id, s.status, e.labels::VARCHAR
FROM episode_selection s JOIN episodes e USING (episode_id)
WHERE s.episode_id IN (SELECT unnest(?::VARCHAR[]))
"""
# A batch's episodes' calls with their token ids, as build-dataset reads them (`turn_tokens`), for the merge
# (lcap.dataset.build.merge), each role's calls a group of their own: where a role's calls stitch into one sample of
# captured ids, that sample's tokens.
_TURNS = """
WITH r AS (
    SELECT turn_id, turn_role(any_value(role)) AS role FROM turns
    WHERE episode_id IN (SELECT unnest($episodes::VARCHAR[])) GROUP BY turn_id)
SELECT tt.episode_id, tt.seq, tt.thread, tt.deployment, tt.rebuilt, tt.truncated,
       tt.prompt_ids::INTEGER[] AS prompt_ids, tt.completion_ids::INTEGER[] AS completion_ids,
       (CASE WHEN len(tt.logprobs) = len(tt.completion_ids) THEN tt.logprobs
             ELSE list_transform(tt.completion_ids, lambda x: 0.0) END)::FLOAT[] AS logprobs,
       r.role AS group_id
FROM turn_tokens tt JOIN r USING (turn_id)
WHERE tt.episode_id IN (SELECT unnest($episodes::VARCHAR[]))
  AND tt.prompt_ids IS NOT NULL AND tt.completion_ids IS NOT NULL
"""
_TOKEN_COLUMNS = ("prompt_ids", "completion_ids", "loss_mask", "logprobs")


@dataclass
class ExportReport:
    format: str
    out: str
    episodes: int = 0  # chosen
    exported: int = 0  # episodes with a conversation written
    conversations: int = 0  # written: one per episode and role
    tasks: int = 0  # verl's RL prompts
    with_token_ids: int = 0  # conversations
    skipped: dict[str, int] = field(default_factory=dict)  # conversations, by why

    def line(self) -> str:
        skipped = _skipped_text(self.skipped)
        roles = f" ({self.conversations} conversations: one per role)" if self.conversations != self.exported else ""
        extra = f", {self.tasks} task prompts" if self.format == "verl" else ""
        ids = f", {self.with_token_ids} with token ids" if self.format == "hf" else ""
        return (
            f"exported {self.exported} of {self.episodes} episodes{roles} as {self.format}{extra}{ids} -> "
            f"{self.out} (skipped: {skipped})"
        )


def _skipped_text(skipped: dict[str, int]) -> str:
    return ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())) or "none"


class _Nothing(Exception):
    """No record reached a file: it is not moved into place (an earlier export there stays)."""


def export(
    store: Store, *, format: str, out: Path, where: str | None = None, batch_rows: int = BATCH_ROWS
) -> ExportReport:
    """Write the episodes `where` chooses from `episode_selection` (all without it) to `out` in `format`, streaming
    them from the store `batch_rows` episodes at a time."""
    if format not in FORMATS:
        raise LcapError(f"unknown export format {format!r}: use {', '.join(FORMATS)}")
    if Path(out).resolve() == store.path.resolve():
        raise LcapError(f"--out {out} is the store itself: name another file")
    episodes = None if where is None else select_episodes(store, where)
    if where is None:
        with store.connect():  # a store from an older lcap gets the current views
            pass
    report = ExportReport(format=format, out=str(out))
    skipped: Counter[str] = Counter()
    out = Path(out)
    made: list[Path] = []
    shown = Reporter("export", None, lambda: "conversations written")
    try:
        with shown, store.connect(read_only=True) as con:
            report.episodes = len(episodes) if episodes is not None else _chosen(con)
            records = _counted(
                conversations(con, episodes, tokens=format == "hf", skipped=skipped, batch_rows=batch_rows),
                report,
                shown,
            )
            if format == "openai":
                _write_openai(records, out)
            elif format == "hf":
                disk = out / HF_DISK_SPLIT / HF_DISK_FILE
                _write_parquet(records, HF_SCHEMA, out / HF_DATA_FILE, batch_rows, made, stream=disk)
                _write_disk_layout(out)
            else:
                tasks = _Tasks()
                _write_parquet(tasks.seen(records), VERL_SFT_SCHEMA, out / VERL_SFT_FILE, batch_rows, made)
                firsts = conversations(con, episodes, tokens=False, batch_rows=batch_rows, only=tasks.first_episodes())
                report.tasks = len(tasks.first)
                _write_parquet(tasks.prompts(firsts), VERL_RL_SCHEMA, out / VERL_RL_FILE, batch_rows, made)
    except _Nothing:
        for folder in reversed(made):  # the folders this export made, now empty
            folder.rmdir()
        raise LcapError(
            f"nothing exported: {report.episodes} episodes chosen, none with a conversation "
            f"(skipped: {_skipped_text(skipped)}); nothing written"
        ) from None
    except OSError as exc:
        raise LcapError(f"cannot write {out}: {exc.strerror or exc}") from None
    report.skipped = dict(skipped)
    return report


def _counted(records: Iterator[dict[str, Any]], report: ExportReport, shown: Reporter) -> Iterator[dict[str, Any]]:
    last = None
    for r in records:  # an episode's conversations come one after another
        report.exported += r["episode_id"] != last
        last = r["episode_id"]
        report.conversations += 1
        report.with_token_ids += r["prompt_ids"] is not None
        shown.advance()
        yield r


def _chosen(con: Any) -> int:
    return con.execute("SELECT count(*) FROM episode_selection").fetchall()[0][0]


def conversations(
    con: Any,
    episodes: list[str] | None,
    *,
    tokens: bool,
    skipped: Counter[str] | None = None,
    batch_rows: int = BATCH_ROWS,
    only: list[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """The chosen episodes (None: all; of them, `only` these) as redacted records, one per episode and role, oldest
    first, fetched `batch_rows` at a time, with the token columns when `tokens` (else None); those skipped are counted
    in `skipped`, by why."""
    skipped = Counter() if skipped is None else skipped
    # The keys as one Arrow table (a few columns of labels an episode); the calls' text a batch at a time.
    keys = con.sql(_EPISODES, params={"episodes": episodes}).to_arrow_table()
    if only is not None:  # of the selection, these episodes (a long list in SQL's IN is slow)
        keys = keys.filter(pc.is_in(keys["episode_id"], pa.array(only, pa.string())))
    for start in range(0, keys.num_rows, batch_rows):
        rows = keys.slice(start, batch_rows).to_pylist()
        calls = _calls(con, rows)
        ids = _one_sample_tokens(con, list({r["episode_id"] for r in rows})) if tokens else {}
        for row in rows:
            row.update(calls.get(row["turn_id"]) or {"dialect": None})
            row.update(ids.get((row["episode_id"], row["role"])) or dict.fromkeys(_TOKEN_COLUMNS))
            record = _record(row)
            if isinstance(record, str):
                skipped[record] += 1
                continue
            yield _redacted(record)


def _one_sample_tokens(con: Any, episodes: list[str]) -> dict[tuple[str, str], dict[str, Any]]:
    """Of `episodes`' roles, by (episode, role), those whose calls merge into one sample of captured ids (none
    rebuilt): that sample's tokens, by the rule build-dataset trains on (lcap.dataset.build.merge)."""
    samples = merge_turns(con.sql(_TURNS, params={"episodes": episodes}).to_arrow_table())
    columns = ["episode_id", "group_id", "rebuilt", "prompt_ids", "completion_ids", "env_mask", "logprobs"]
    rows = samples.select(columns).to_pylist()
    parts = Counter((row["episode_id"], row["group_id"]) for row in rows)
    return {
        (row["episode_id"], row["group_id"]): {
            "prompt_ids": row["prompt_ids"],
            "completion_ids": row["completion_ids"],
            "loss_mask": row["env_mask"],
            "logprobs": row["logprobs"],
        }
        for row in rows
        if parts[row["episode_id"], row["group_id"]] == 1 and not row["rebuilt"]
    }


def transcripts(con: Any, episodes: list[str]) -> dict[str, dict[str, Any]]:
    """What `lcap rescore` and the judges are given of each episode: the export's record in the OpenAI chat form
    (the messages of its conversation's call and that call's answer, redacted, an answer cut by the token limit
    included), its `status`, `labels` and `truncated` (the answer was cut by the token limit), `tools` as a list;
    `messages` None with `no_messages` saying why where the export has no conversation for it. Those of the
    episode's one conversation: of an agent whose jobs call as roles, the role whose call holds the most messages;
    `roles` has every role's (`role`, `messages`, `tools`, `no_messages`, `truncated`), the first call's first."""
    keys = con.sql(_EPISODES, params={"episodes": episodes}).to_arrow_table().to_pylist()
    calls = _calls(con, keys)
    facts = {
        episode: (status, json.loads(labels or "{}"))
        for episode, status, labels in con.execute(_STATUS_AND_LABELS, [episodes]).fetchall()
    }
    out: dict[str, dict[str, Any]] = {}
    for row in keys:
        row.update(calls.get(row["turn_id"]) or {"dialect": None, "truncated": False})
        said = _said(row)
        base = out.get(row["episode_id"])
        if base is None:
            status, labels = facts.get(row["episode_id"], (None, {}))
            base = {k: row[k] for k in ("episode_id", "task_id", "round", "split", "run", "model", "deployment")}
            base.update(status=status, labels=labels, roles=[])
            out[row["episode_id"]] = base
        if row["role"] is not None:
            base["roles"].append({"role": row["role"], **said})
        if row["rank"] in (1, None):  # the episode's one conversation
            base.update(said)
    return out


def _said(row: dict[str, Any]) -> dict[str, Any]:
    """A transcript's conversation of the call in `row`: messages, tools, truncated, or why there are none."""
    said: dict[str, Any] = {"truncated": bool(row["truncated"]), "messages": None, "tools": None}
    record = _record({**row, "truncated": False, **dict.fromkeys(_TOKEN_COLUMNS)})
    if isinstance(record, str):
        return {**said, "no_messages": record}
    record = _redacted(record)
    tools = json.loads(record["tools"]) if record["tools"] else None
    return {**said, "messages": record["messages"], "tools": tools, "no_messages": None}


def _calls(con: Any, keys: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The text of the calls `keys` (rows of `_EPISODES`) chose, by turn id."""
    turns = [r["turn_id"] for r in keys if r["turn_id"] is not None]
    return {c["turn_id"]: c for c in con.sql(_CALLS, params={"turns": turns}).to_arrow_table().to_pylist()}


def _record(row: dict[str, Any]) -> dict[str, Any] | str:
    """The episode as one record (labels, messages in OpenAI's chat form, tools as JSON text, the token columns),
    or why it is skipped."""
    if row["dialect"] is None:
        return "no successful call"
    if row["dialect"] not in _DIALECTS:
        return f"{row['dialect']} dialect (a prompt with no roles)"
    if row["truncated"]:
        return "answer cut by the token limit"
    if not row["completion_text"] and not row["tool_calls"]:
        return "empty answer"
    request = json.loads(row["request"])
    if row["dialect"] == "messages":
        prompt, tools = chat_from_anthropic(request)
    elif row["dialect"] == "responses":
        conversation = chat_from_responses(request)
        if conversation is None:
            return "responses call whose request does not hold its conversation"
        prompt, tools = conversation
    else:
        prompt, tools = request.get("messages") or [], request.get("tools")
    messages = [_message(m) for m in prompt if isinstance(m, dict)]
    if any(m is None for m in messages):
        return "not text"
    messages.append(_answer(row))
    return {
        **{k: row[k] for k in ("episode_id", "task_id", "round", "split", "run", "model", "deployment", "reward")},
        "role": row["role"],
        "rank": row["rank"],  # 1: the conversation of the whole episode (`_EPISODES`)
        "reward_source": row["reward_source"],
        "labels": row.get("labels"),
        "messages": messages,
        "tools": json.dumps(tools, ensure_ascii=False) if tools else None,
        **{k: row[k] for k in _TOKEN_COLUMNS},
    }


def _message(m: dict[str, Any]) -> dict[str, Any] | None:
    content = _text(m.get("content"))
    if content is False:
        return None
    calls = [_tool_call(c) for c in m.get("tool_calls") or () if isinstance(c, dict)]
    return {
        "role": m.get("role"),
        "content": content,
        "reasoning_content": m.get("reasoning_content") or m.get("reasoning"),
        "tool_calls": calls or None,
        "tool_call_id": m.get("tool_call_id"),
        "name": m.get("name"),
    }


def _text(content: Any) -> str | bool | None:
    """A message's content as text; False when it holds a part that is not text (an image, audio)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    return False


def _tool_call(c: dict[str, Any]) -> dict[str, Any]:
    raw = c.get("function")
    function: dict[str, Any] = raw if isinstance(raw, dict) else c  # chat's {function: {...}}, or the turn's flat call
    return {
        "id": c.get("id"),
        "type": "function",
        "function": {"name": function.get("name"), "arguments": _arguments(function.get("arguments"))},
    }


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {}, ensure_ascii=False)


def _answer(row: dict[str, Any]) -> dict[str, Any]:
    calls = json.loads(row["tool_calls"]) if row["tool_calls"] else []
    return {
        "role": "assistant",
        "content": row["completion_text"],
        "reasoning_content": row["reasoning"],
        "tool_calls": [_tool_call(c) for c in calls if isinstance(c, dict)] or None,
        "tool_call_id": None,
        "name": None,
    }


def _redacted(record: dict[str, Any]) -> dict[str, Any]:
    """The store's redaction over a whole record: credential-named fields blanked, key-shaped strings replaced."""
    text = redact_keys(json.dumps(redact_json(record), ensure_ascii=False)) or "{}"
    out: dict[str, Any] = json.loads(text)
    return out


def _write_openai(records: Iterator[dict[str, Any]], out: Path) -> None:
    if out.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a folder: openai's export is one file", str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out, mode=0o600) as tmp, tmp.open("w", encoding="utf-8") as f:
        lines = 0
        for r in records:
            line: dict[str, Any] = {"messages": [_openai_message(m) for m in r["messages"]]}
            if r["tools"]:
                line["tools"] = json.loads(r["tools"])
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
            lines += 1
        if not lines:
            raise _Nothing


def _write_parquet(
    rows: Iterator[dict[str, Any]],
    schema: pa.Schema,
    path: Path,
    batch_rows: int,
    made: list[Path],
    *,
    stream: Path | None = None,
) -> None:
    """`rows` as one Parquet file, a row group per `batch_rows` rows, and as an Arrow stream at `stream` too (the
    file `save_to_disk` writes); `made` gets the folders it creates."""
    for file in (path, stream) if stream is not None else (path,):
        made.extend(reversed([p for p in (file.parent, *file.parent.parents) if not p.exists() and p not in made]))
        file.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(replacing(path, mode=0o600))
        tmp_stream = stack.enter_context(replacing(stream, mode=0o600)) if stream is not None else None
        writers: list[Any] = []
        try:
            rows = iter(rows)
            while batch := [{k: row.get(k) for k in schema.names} for row in itertools.islice(rows, batch_rows)]:
                if not writers:
                    writers.append(pq.ParquetWriter(tmp, schema))
                    if tmp_stream is not None:
                        writers.append(pa.ipc.new_stream(str(tmp_stream), schema))
                table = pa.Table.from_pylist(batch, schema=schema)
                for writer in writers:
                    writer.write_table(table)
        finally:
            for writer in writers:
                writer.close()
        if not writers:
            raise _Nothing


def _write_disk_layout(out: Path) -> None:
    """What `datasets.load_from_disk` reads beside the Arrow stream: a DatasetDict of one split (its list in
    `dataset_dict.json`), the split's state (its files; no format) and info (the features come from the stream's
    schema)."""
    state: dict[str, Any] = {
        "_data_files": [{"filename": HF_DISK_FILE}],
        "_fingerprint": secrets.token_hex(8),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": HF_DISK_SPLIT,
    }
    atomic_write(out / HF_DISK_SPLIT / "state.json", json.dumps(state, indent=2), mode=0o600)
    atomic_write(out / HF_DISK_SPLIT / "dataset_info.json", json.dumps({"description": "lcap export"}), mode=0o600)
    atomic_write(out / "dataset_dict.json", json.dumps({"splits": [HF_DISK_SPLIT]}), mode=0o600)


def _openai_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as OpenAI's fine-tuning reads it: only the fields it knows, none of them null."""
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    out = {k: m[k] for k in keep if m.get(k) is not None}
    if m["role"] == "assistant" and "content" not in out and "tool_calls" not in out:
        out["content"] = ""
    return out


@dataclass
class _Task:
    index: int
    first: str  # its first exported episode
    split: str | None
    episodes: int = 0
    rewarded: int = 0
    reward_sum: float = 0.0


class _Tasks:
    """verl's RL prompts, one row a task: counted while the SFT rows stream past (an episode's conversations one
    after another), then each task's first episode's first conversation's messages before its first answer, read
    again."""

    def __init__(self) -> None:
        self.first: dict[str, _Task] = {}

    def seen(self, records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        last = None
        for r in records:
            if r["episode_id"] == last:  # the episode's next role
                yield r
                continue
            last = r["episode_id"]
            key = r["task_id"] or r["episode_id"]
            task = self.first.get(key)
            if task is None:
                task = self.first[key] = _Task(len(self.first), r["episode_id"], r["split"])
            task.episodes += 1
            if r["reward"] is not None:
                task.rewarded += 1
                task.reward_sum += r["reward"]
            yield r

    def first_episodes(self) -> list[str]:
        return [t.first for t in self.first.values()]

    def prompts(self, firsts: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        done: set[str] = set()
        for r in firsts:
            key = r["task_id"] or r["episode_id"]
            if key in done:  # the first episode's other roles
                continue
            done.add(key)
            task = self.first[key]
            messages = r["messages"]
            end = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
            yield {
                "data_source": VERL_DATA_SOURCE,
                "prompt": messages[:end],
                "ability": "agent",
                "reward_model": {"style": "lcap", "ground_truth": key},
                "extra_info": {
                    "split": task.split,
                    "index": task.index,
                    "task_id": key,
                    "episodes": task.episodes,
                    "mean_reward": task.reward_sum / task.rewarded if task.rewarded else None,
                    "tools": r["tools"],
                },
            }
