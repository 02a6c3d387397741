"""`lcap export`: chosen episodes as the files other trainers read.

One conversation per episode: the messages of its call whose prompt holds the most messages, and that call's
answer (from the parsed columns capture fills for every dialect: text, tool calls, reasoning). Chat calls are
read as they are, Anthropic Messages calls as build-dataset's re-rendering reads them (`chat_from_anthropic`:
text, tool uses and tool results); Responses and legacy completions calls are skipped and counted. Formats:

- `openai`: OpenAI's chat fine-tuning JSONL, one `{"messages", "tools"}` object a line.
- `hf`: a Hugging Face dataset folder (`data/train-00000-of-00001.parquet`) that `datasets.load_dataset(PATH)`
  opens: messages, tools, the episode's labels and reward, and its token ids with the loss mask where the
  episode's calls were captured with ids and stitch into one sample (the `samples` view).
- `verl`: `sft.parquet` (verl's multi-turn SFT data: `messages`, `tools`) and `rl.parquet` (verl's RL prompt
  data, one row a task: `data_source`, `prompt`, `ability`, `reward_model`, `extra_info`).

The selection, the joins and the choice of each episode's call are SQL over the store's views; Python shapes
each chosen call's JSON into messages. Every record goes through the redaction the store's writer applies
(`redact_json`, then `redact_keys` over the text), so no secret leaves, whatever wrote the store.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lcap.capture.trust.redact import redact_json, redact_keys
from lcap.config import LcapError
from lcap.dataset.build.rebuild import chat_from_anthropic
from lcap.dataset.build.select import select_episodes
from lcap.store import Store

FORMATS = ("openai", "hf", "verl")
HF_DATA_FILE = "data/train-00000-of-00001.parquet"
VERL_SFT_FILE = "sft.parquet"
VERL_RL_FILE = "rl.parquet"
VERL_DATA_SOURCE = "lcap"
_DIALECTS = ("chat", "messages")  # OpenAI chat completions, Anthropic Messages (read as chat)

# The episodes chosen, each with its conversation's call (successful, a dialect export reads preferred: the call
# whose request holds the most messages, the latest of equals) and, where its calls stitch into one sample of
# captured ids, that sample's tokens.
_EPISODES = """
WITH chosen AS (
    SELECT * FROM episode_selection
    WHERE $episodes::VARCHAR[] IS NULL OR episode_id IN (SELECT unnest($episodes::VARCHAR[]))),
call AS (
    SELECT t.episode_id, t.dialect, t.request,
           t.completion_text, t.tool_calls, t.reasoning, cut_by_token_limit(t.finish_reason) AS truncated
    FROM turns t SEMI JOIN chosen USING (episode_id)
    WHERE t.error IS NULL AND coalesce(t.status_code, 200) < 400 AND t.request IS NOT NULL
    QUALIFY row_number() OVER (
        PARTITION BY t.episode_id
        ORDER BY t.dialect IN ('chat', 'messages') DESC, coalesce(json_array_length(t.request->'messages'), 0) DESC,
                 t.seq DESC) = 1)
SELECT c.episode_id, c.task_id, c.round, c.split, c.run, c.model, c.deployment, c.reward, c.reward_source,
       c.status, call.dialect, call.request::VARCHAR AS request,
       call.completion_text, call.tool_calls::VARCHAR AS tool_calls, call.reasoning, call.truncated
FROM chosen c LEFT JOIN call USING (episode_id)
ORDER BY c.started_at, c.episode_id
"""

_TOKENS = """
SELECT episode_id, any_value(prompt_ids) AS prompt_ids, any_value(completion_ids) AS completion_ids,
       any_value(env_mask) AS loss_mask, any_value(logprobs) AS logprobs
FROM samples
WHERE $episodes::VARCHAR[] IS NULL OR episode_id IN (SELECT unnest($episodes::VARCHAR[]))
GROUP BY episode_id HAVING count(*) = 1 AND NOT bool_or(rebuilt)
"""

_TOOL_CALL = pa.struct(
    [
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)
MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", pa.list_(_TOOL_CALL)),
        ("tool_call_id", pa.string()),
        ("name", pa.string()),
    ]
)
# Tools are JSON text in Parquet: their parameter schemas differ in shape, which one Arrow struct cannot hold.
HF_SCHEMA = pa.schema(
    [
        ("episode_id", pa.string()),
        ("task_id", pa.string()),
        ("round", pa.int32()),
        ("split", pa.string()),
        ("run", pa.string()),
        ("model", pa.string()),
        ("deployment", pa.string()),
        ("reward", pa.float64()),
        ("reward_source", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("tools", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
    ]
)
VERL_SFT_SCHEMA = pa.schema(
    [("messages", pa.list_(MESSAGE)), ("tools", pa.string()), ("episode_id", pa.string()), ("reward", pa.float64())]
)
VERL_RL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("task_id", pa.string()),
                    ("episodes", pa.int64()),
                    ("mean_reward", pa.float64()),
                    ("tools", pa.string()),
                ]
            ),
        ),
    ]
)


@dataclass
class ExportReport:
    format: str
    out: str
    episodes: int = 0
    exported: int = 0
    tasks: int = 0  # verl's RL prompts
    with_token_ids: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        extra = f", {self.tasks} task prompts" if self.format == "verl" else ""
        ids = f", {self.with_token_ids} with token ids" if self.format == "hf" else ""
        return (
            f"exported {self.exported} of {self.episodes} episodes as {self.format}{extra}{ids} -> {self.out} "
            f"(skipped: {skipped})"
        )


def export(store: Store, *, format: str, out: Path, where: str | None = None) -> ExportReport:
    """Write the episodes `where` chooses from `episode_selection` (all without it) to `out` in `format`."""
    if format not in FORMATS:
        raise LcapError(f"unknown export format {format!r}: use {', '.join(FORMATS)}")
    if Path(out).resolve() == store.path.resolve():
        raise LcapError(f"--out {out} is the store itself: name another file")
    episodes = None if where is None else select_episodes(store, where)
    if where is None:
        with store.connect():  # a store from an older lcap gets the current views
            pass
    with store.connect(read_only=True) as con:
        records, skipped = conversations(con, episodes, tokens=format == "hf")
        report = ExportReport(format=format, out=str(out), episodes=len(records) + sum(skipped.values()))
    report.skipped = dict(skipped)
    report.exported = len(records)
    report.with_token_ids = sum(r["prompt_ids"] is not None for r in records)
    if not records:  # before writing: an earlier export at `out` stays as it was
        raise LcapError(
            f"nothing exported: {report.episodes} episodes chosen, none with a chat conversation "
            f"(skipped: {', '.join(f'{n} {why}' for why, n in sorted(skipped.items())) or 'none'}); nothing written"
        )
    out = Path(out)
    try:
        if format == "openai":
            _write_openai(records, out)
        elif format == "hf":
            _write_table(records, HF_SCHEMA, out / HF_DATA_FILE)
        else:
            tasks = _verl_tasks(records)
            report.tasks = len(tasks)
            _write_table(records, VERL_SFT_SCHEMA, out / VERL_SFT_FILE)
            _write_table(tasks, VERL_RL_SCHEMA, out / VERL_RL_FILE)
    except OSError as exc:
        raise LcapError(f"cannot write {out}: {exc.strerror or exc}") from None
    return report


def conversations(con: Any, episodes: list[str] | None, *, tokens: bool) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The chosen episodes (None: all) as redacted records, oldest first, with the token columns when `tokens`
    (else None), and the count of those skipped, by why."""
    rows = con.sql(_EPISODES, params={"episodes": episodes}).to_arrow_table().to_pylist()
    ids: dict[str, dict[str, Any]] = {}
    if tokens:
        ids = {r["episode_id"]: r for r in con.sql(_TOKENS, params={"episodes": episodes}).to_arrow_table().to_pylist()}
    skipped: Counter[str] = Counter()
    records = []
    for row in rows:
        why = _unusable(row)
        if why:
            skipped[why] += 1
            continue
        row.update(
            ids.get(row["episode_id"]) or dict.fromkeys(("prompt_ids", "completion_ids", "loss_mask", "logprobs"))
        )
        record = _redacted(_record(row))
        if record is None:
            skipped["not text"] += 1
            continue
        records.append(record)
    return records, skipped


def transcripts(con: Any, episodes: list[str]) -> dict[str, dict[str, Any]]:
    """What `lcap rescore` hands a verifier for each episode: the export's record in the OpenAI chat form (the
    messages of its call with the longest prompt and that call's answer, redacted), its `status`, `labels` and
    `truncated` (the answer was cut by the token limit), `tools` as a list; `messages` None with `no_messages`
    saying why where the export has no conversation for it."""
    rows = con.sql(_EPISODES, params={"episodes": episodes}).to_arrow_table().to_pylist()
    labels = dict(
        con.execute(
            "SELECT episode_id, labels::VARCHAR FROM episodes WHERE episode_id IN (SELECT unnest(?::VARCHAR[]))",
            [episodes],
        ).fetchall()
    )
    out = {}
    for row in rows:
        base = {k: row[k] for k in ("episode_id", "task_id", "round", "split", "run", "model", "deployment")}
        base.update(status=row["status"], labels=json.loads(labels.get(row["episode_id"]) or "{}"))
        base.update(truncated=bool(row["truncated"]), messages=None, tools=None, no_messages=None)
        why = "no successful call" if row["dialect"] is None else None
        if why is None and row["dialect"] not in _DIALECTS:
            why = f"{row['dialect']} dialect (chat and messages only)"
        record = (
            None
            if why
            else _redacted(_record(row | dict.fromkeys(("prompt_ids", "completion_ids", "loss_mask", "logprobs"))))
        )
        if record is None:
            base["no_messages"] = why or "not text"
        else:
            base.update(messages=record["messages"], tools=json.loads(record["tools"]) if record["tools"] else None)
        out[row["episode_id"]] = base
    return out


def _unusable(row: dict[str, Any]) -> str | None:
    if row["dialect"] is None:
        return "no successful call"
    if row["dialect"] not in _DIALECTS:
        return f"{row['dialect']} dialect (chat and messages only)"
    if row["truncated"]:
        return "answer cut by the token limit"
    if not row["completion_text"] and not row["tool_calls"]:
        return "empty answer"
    return None


def _record(row: dict[str, Any]) -> dict[str, Any] | None:
    """The episode as one record: labels, messages in OpenAI's chat form (None: a part that is not text), tools
    as JSON text, and the token columns."""
    request = json.loads(row["request"])
    if row["dialect"] == "messages":
        prompt, tools = chat_from_anthropic(request)
    else:
        prompt, tools = request.get("messages") or [], request.get("tools")
    messages = [_message(m) for m in prompt if isinstance(m, dict)]
    if any(m is None for m in messages):
        return None
    messages.append(_answer(row))
    return {
        **{k: row[k] for k in ("episode_id", "task_id", "round", "split", "run", "model", "deployment", "reward")},
        "reward_source": row["reward_source"],
        "messages": messages,
        "tools": json.dumps(tools, ensure_ascii=False) if tools else None,
        **{k: row[k] for k in ("prompt_ids", "completion_ids", "loss_mask", "logprobs")},
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
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                isinstance(part, dict)
                and part.get("type") in ("text", "input_text")
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                return False
        return "".join(texts)
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


def _redacted(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The store's redaction over a whole record: credential-named fields blanked, key-shaped strings replaced."""
    if record is None:
        return None
    text = redact_keys(json.dumps(redact_json(record), ensure_ascii=False)) or "{}"
    out: dict[str, Any] = json.loads(text)
    return out


def _write_openai(records: list[dict[str, Any]], out: Path) -> None:
    if out.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a folder: openai's export is one file", str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    with _replacing(out) as tmp, tmp.open("w", encoding="utf-8") as f:
        for r in records:
            line: dict[str, Any] = {"messages": [_openai_message(m) for m in r["messages"]]}
            if r["tools"]:
                line["tools"] = json.loads(r["tools"])
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A new file of its own beside `path` (not a name a link could already hold) to write, moved over `path` when
    the block ends, removed if it fails."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _openai_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as OpenAI's fine-tuning reads it: only the fields it knows, none of them null."""
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    out = {k: m[k] for k in keep if m.get(k) is not None}
    if m["role"] == "assistant" and "content" not in out and "tool_calls" not in out:
        out["content"] = ""
    return out


def _verl_tasks(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """verl's RL prompts: one row a task, its first episode's messages before the first answer."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_task.setdefault(r["task_id"] or r["episode_id"], []).append(r)
    tasks = []
    for index, (task, episodes) in enumerate(by_task.items()):
        first = episodes[0]["messages"]
        end = next((i for i, m in enumerate(first) if m["role"] == "assistant"), len(first))
        rewards = [e["reward"] for e in episodes if e["reward"] is not None]
        tasks.append(
            {
                "data_source": VERL_DATA_SOURCE,
                "prompt": first[:end],
                "ability": "agent",
                "reward_model": {"style": "lcap", "ground_truth": task},
                "extra_info": {
                    "split": episodes[0]["split"],
                    "index": index,
                    "task_id": task,
                    "episodes": len(episodes),
                    "mean_reward": sum(rewards) / len(rewards) if rewards else None,
                    "tools": episodes[0]["tools"],
                },
            }
        )
    return tasks


def _write_table(rows: list[dict[str, Any]], schema: pa.Schema, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema=schema)
    with _replacing(path) as tmp:
        pq.write_table(table, tmp)
