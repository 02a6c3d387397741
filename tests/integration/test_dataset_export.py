"""lcap export: each format loaded back with its ecosystem's reader; --where; secrets redacted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures_dataset import chat_turns
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionMessageParam,
    ChatCompletionSystemMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionToolParam,
    ChatCompletionUserMessageParam,
)
from pydantic import TypeAdapter

from lcap.config import LcapError
from lcap.dataset.build.export import HF_DATA_FILE, ExportReport, export, transcripts

LCAP = str(Path(sys.executable).parent / "lcap")
SECRET = "sk-proj-4f9Qx7Lm2Rt8Vb3Nc6Kd1Hs5Jw0Pz"  # key-shaped: the store's redaction replaces it
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a calculator agent."}


def _tool_episode(answer: str, *, api_key_in: str = "user") -> list[dict]:
    """Two chat calls: the model calls the calculator, then answers; ids captured, the second prompt extends the
    first (one sample)."""
    user = {"role": "user", "content": [{"type": "text", "text": f"What is 17*25? (my key: {SECRET})"}]}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expr": "17*25", "token": SECRET})},
    }
    first, second = chat_turns([5, 6], [7])
    first.update(
        request={"model": "policy", "messages": [SYSTEM, user], "tools": TOOLS, "api_key": "not-a-key-shape-but-named"},
        tool_calls=[{"id": "call_1", "name": "calculator", "arguments": call["function"]["arguments"]}],
        model_served="policy",
    )
    history = [SYSTEM, user, {"role": "assistant", "content": None, "tool_calls": [call]}]
    second.update(
        request={
            "model": "policy",
            "messages": [*history, {"role": "tool", "tool_call_id": "call_1", "content": "425"}],
            "tools": TOOLS,
        },
        completion_text=answer,
        model_served="policy",
    )
    return _stored([first, second])


def _stored(turns: list[dict]) -> list[dict]:
    """Turns as the writer stores them: JSON columns as JSON text."""
    return [{k: json.dumps(v) if k in ("request", "tool_calls") else v for k, v in t.items()} for t in turns]


@pytest.fixture
def captured(builder, dstore):
    builder.episode("good", task="mul-1", sample=0, reward=1.0, turns=_tool_episode("425"))
    builder.episode("bad", task="mul-1", sample=1, reward=0.0, turns=_tool_episode("424"))
    builder.episode(
        "plain",
        task="hello",
        reward=1.0,
        turns=_stored(
            [
                {
                    "request": {"messages": [{"role": "user", "content": "hi"}]},
                    "completion_text": "hello",
                    "token_source": None,
                    "prompt_token_ids": None,
                    "completion_token_ids": None,
                }
            ]
        ),
    )
    builder.episode(
        "anthropic",
        task="mul-2",
        reward=1.0,
        turns=_stored(
            [
                {
                    "dialect": "messages",
                    "request": {
                        "system": "You add.",
                        "messages": [
                            {"role": "user", "content": "2+2?"},
                            {
                                "role": "assistant",
                                "content": [
                                    {"type": "tool_use", "id": "tu_1", "name": "add", "input": {"a": 2, "b": 2}}
                                ],
                            },
                            {
                                "role": "user",
                                "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "4"}],
                            },
                        ],
                        "tools": [{"name": "add", "description": "Add.", "input_schema": {"type": "object"}}],
                    },
                    "completion_text": "4",
                }
            ]
        ),
    )
    builder.episode(
        "cut",
        task="mul-3",
        reward=0.0,
        turns=_stored([{"request": {"messages": [SYSTEM]}, "completion_text": "42 and", "finish_reason": "length"}]),
    )
    builder.episode("responses", task="mul-4", reward=1.0, turns=_stored([{"dialect": "responses", **RESPONSES}]))
    chained = {"dialect": "responses", "request": {"previous_response_id": "resp_1", "input": "and 3*4?"}}
    builder.episode("chained", task="mul-5", reward=0.0, turns=_stored([{**chained, "completion_text": "12"}]))
    completion = {"dialect": "completions", "request": {"prompt": "2*3="}, "completion_text": "6"}
    builder.episode("completions", task="mul-6", reward=0.0, turns=_stored([completion]))
    return dstore


# A Responses call whose request holds its whole conversation: instructions, a developer message, a function call
# and its output, a reasoning summary; a built-in tool beside the function tool.
RESPONSES = {
    "request": {
        "instructions": "You multiply.",
        "input": [
            {"role": "developer", "content": "Use the calculator."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2*3?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "call it"}]},
            {
                "type": "function_call",
                "id": "fc_a",
                "call_id": "fc_1",
                "name": "calculator",
                "arguments": '{"expr": "2*3"}',
            },
            {"type": "function_call_output", "call_id": "fc_1", "output": "6"},
        ],
        "tools": [
            {"type": "function", "name": "calculator", "description": "Multiply.", "parameters": {"type": "object"}},
            {"type": "web_search"},
        ],
    },
    "completion_text": "6",
}


def _all_text(path: Path) -> str:
    if path.is_dir():
        return "\n".join(_all_text(p) for p in sorted(path.rglob("*")) if p.is_file())
    if path.suffix == ".parquet":
        return json.dumps(pq.read_table(path).to_pylist(), default=str)
    if path.name == "state.json":  # its _fingerprint is an id of each export's own (datasets' cache key)
        return json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "_fingerprint"})
    if path.suffix == ".arrow":  # load_from_disk's copy, an Arrow stream
        return json.dumps(pa.ipc.open_stream(path.read_bytes()).read_all().to_pylist(), default=str)
    return path.read_text()


_ROLES = {
    "system": ChatCompletionSystemMessageParam,
    "user": ChatCompletionUserMessageParam,
    "assistant": ChatCompletionAssistantMessageParam,
    "tool": ChatCompletionToolMessageParam,
}


def test_openai_jsonl_reads_as_the_openai_packages_types(captured, tmp_path):
    out = tmp_path / "ft.jsonl"
    report = export(captured, format="openai", out=out)
    assert report.episodes == 8 and report.exported == 5
    assert report.skipped == {
        "answer cut by the token limit": 1,
        "responses call whose request does not hold its conversation": 1,
        "completions dialect (a prompt with no roles)": 1,
    }
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    messages_type = TypeAdapter(list[ChatCompletionMessageParam])
    tools_type = TypeAdapter(list[ChatCompletionToolParam])
    for line in lines:
        assert set(line) <= {"messages", "tools"}
        messages_type.validate_python(line["messages"], strict=True)
        for m in line["messages"]:  # no field OpenAI's types do not know (pydantic ignores extra TypedDict keys)
            typed = _ROLES[m["role"]]
            assert set(m) <= typed.__required_keys__ | typed.__optional_keys__, m
        if "tools" in line:
            tools_type.validate_python(line["tools"], strict=True)
    good = lines[0]
    assert [m["role"] for m in good["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert good["messages"][2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert good["messages"][-1] == {"role": "assistant", "content": "425"}
    assert good["tools"] == TOOLS
    assert lines[2]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    anthropic = lines[3]  # Anthropic Messages, read as chat: system, tool use and tool result included
    assert [m["role"] for m in anthropic["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert anthropic["messages"][2]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 2}'}
    assert anthropic["messages"][3] == {"role": "tool", "tool_call_id": "tu_1", "content": "4"}
    assert anthropic["tools"][0]["function"]["name"] == "add"
    responses = lines[4]  # Responses, read as chat: instructions and developer as system, the function call and output
    assert responses["messages"] == [
        {"role": "system", "content": "You multiply."},
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "2*3?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "fc_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expr": "2*3"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "fc_1", "content": "6"},
        {"role": "assistant", "content": "6"},
    ]
    assert responses["tools"] == [
        {
            "type": "function",
            "function": {"name": "calculator", "description": "Multiply.", "parameters": {"type": "object"}},
        }
    ]


def test_hf_folder_opens_with_load_dataset(captured, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "hf"
    report = export(captured, format="hf", out=out, where="reward > 0 AND task_id IN ('mul-1', 'hello')")
    assert report.exported == 2 and report.with_token_ids == 1
    ds = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache"))["train"]
    rows = {r["episode_id"]: r for r in ds}
    assert set(rows) == {"good", "plain"}
    good = rows["good"]
    assert good["reward"] == 1.0 and good["task_id"] == "mul-1" and good["model"] == "policy"
    assert [m["role"] for m in good["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert json.loads(good["tools"]) == TOOLS
    # the two calls stitch into one sample: prompt, then completion 1, the tokens between (mask 0), completion 2
    assert good["prompt_ids"] == [1, 2, 3]
    assert good["completion_ids"] == [5, 6, 90, 91, 7] and good["loss_mask"] == [1, 1, 0, 0, 1]
    assert rows["plain"]["prompt_ids"] is None  # captured without ids: none exported


def test_hf_folder_opens_with_load_from_disk_and_keeps_a_proxy_episode(captured, builder, tmp_path, monkeypatch):
    """An `lcap proxy` episode (no task, no round: only the labels it was given) keeps its captured ids; the same
    folder opens with `load_from_disk` as with `load_dataset`, rows alike."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    captured.start_episode("proxied", command="python agent.py", cwd="/tmp", labels={"user": "ann"})
    builder.turns("proxied", _tool_episode("425"))
    captured.end_episode("proxied", status="ok", exit_code=0, error=None)
    out = tmp_path / "hf"
    report = export(captured, format="hf", out=out, where="episode_id IN ('proxied', 'good', 'plain')")
    assert report.exported == 3 and report.with_token_ids == 2
    on_disk = datasets.load_from_disk(str(out))["train"]
    loaded = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache"))["train"]
    assert on_disk.to_list() == loaded.to_list()
    rows = {r["episode_id"]: r for r in on_disk}
    proxied = rows["proxied"]
    assert proxied["task_id"] is None and proxied["round"] is None and json.loads(proxied["labels"]) == {"user": "ann"}
    assert proxied["prompt_ids"] == [1, 2, 3] and proxied["completion_ids"] == [5, 6, 90, 91, 7]
    assert json.loads(rows["good"]["labels"])["task"] == "mul-1"


def test_verl_parquet_under_verls_column_names(captured, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "verl"
    report = export(captured, format="verl", out=out, where="task_id = 'mul-1'")
    assert report.exported == 2 and report.tasks == 1
    # multi-turn SFT: data.multiturn.messages_key=messages, tools_key=tools, read with pandas as verl does
    sft = pq.read_table(out / "sft.parquet").to_pandas()
    assert {"messages", "tools"} <= set(sft.columns)
    for messages in sft["messages"]:
        assert [m["role"] for m in messages][-1] == "assistant"
    # RL prompts: RLHFDataset reads data_source, prompt (prompt_key), reward_model, extra_info through `datasets`
    rl = datasets.load_dataset("parquet", data_files=str(out / "rl.parquet"), cache_dir=str(tmp_path / "c"))["train"]
    assert rl.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    (row,) = rl
    assert row["data_source"] == "lcap" and row["reward_model"]["ground_truth"] == "mul-1"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["extra_info"]["index"] == 0 and row["extra_info"]["episodes"] == 2
    assert row["extra_info"]["mean_reward"] == 0.5 and json.loads(row["extra_info"]["tools"]) == TOOLS


def test_no_secret_leaves_in_any_format(captured, tmp_path):
    for fmt, out in (("openai", tmp_path / "a.jsonl"), ("hf", tmp_path / "hf"), ("verl", tmp_path / "verl")):
        export(captured, format=fmt, out=out)
        text = _all_text(out)
        assert SECRET not in text and "[REDACTED]" in text, fmt
        assert "17*25" in text  # the rest of the conversation is there


def test_cli_export_and_its_errors(captured, tmp_path):
    db = str(captured.path)
    run = lambda *a: subprocess.run([LCAP, "export", "--db", db, *a], capture_output=True, text=True, timeout=120)  # noqa: E731
    ok = run("--format", "openai", "--out", str(tmp_path / "x.jsonl"), "--where", "reward = 1")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("exported 4 of 4 episodes as openai")
    bad = run("--format", "csv", "--out", str(tmp_path / "y"))
    assert bad.returncode == 2 and bad.stderr.strip() == "lcap: --format must be openai, hf or verl, not 'csv'"
    sql = run("--out", str(tmp_path / "z"), "--where", "reward >")
    assert sql.returncode == 2 and len(sql.stderr.strip().splitlines()) == 1 and "bad --where" in sql.stderr
    none = run("--out", str(tmp_path / "n"), "--where", "reward > 5")
    assert none.returncode == 2 and "nothing exported: 0 episodes chosen" in none.stderr


def test_an_empty_selection_leaves_an_earlier_export_as_it_was(captured, tmp_path):
    """A --where that chooses nothing is an error before anything is written: the file or folder of an earlier
    export is not replaced by an empty one."""
    tmp_path = tmp_path / "out"
    for fmt, out in (("openai", tmp_path / "a.jsonl"), ("hf", tmp_path / "hf"), ("verl", tmp_path / "verl")):
        export(captured, format=fmt, out=out)
        before = _all_text(out)
        with pytest.raises(LcapError, match="nothing exported: 0 episodes chosen"):
            export(captured, format=fmt, out=out, where="reward > 5")
        assert _all_text(out) == before and before, fmt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "hf", "verl"]


def test_an_out_that_cannot_be_written_is_one_line(captured, tmp_path):
    """--out naming a folder for openai's file, or a file for hf's and verl's folder: one line naming it, and no
    temporary file left beside it."""
    tmp_path = tmp_path / "out"
    folder, file = tmp_path / "folder", tmp_path / "file.jsonl"
    tmp_path.mkdir()
    folder.mkdir()
    file.write_text("keep\n")
    for fmt, out in (("openai", folder), ("hf", file), ("verl", file)):
        with pytest.raises(LcapError) as refused:
            export(captured, format=fmt, out=out)
        assert str(refused.value).startswith(f"cannot write {out}: ") and "\n" not in str(refused.value), fmt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.jsonl", "folder"] and not any(folder.iterdir())
    assert file.read_text() == "keep\n"
    store_bytes = captured.path.read_bytes()
    for out in (captured.path, tmp_path / ".." / captured.path.name):  # the store, however it is named
        with pytest.raises(LcapError, match="is the store itself"):
            export(captured, format="openai", out=out)
    assert captured.path.read_bytes() == store_bytes


def test_a_link_at_the_temporary_name_is_not_written_through(captured, tmp_path):
    """The file is written beside --out under a name of its own, not at a guessable one a link could hold."""
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (tmp_path / "a.jsonl.tmp").symlink_to(victim)
    export(captured, format="openai", out=tmp_path / "a.jsonl")
    assert victim.read_text() == "mine\n" and "17*25" in (tmp_path / "a.jsonl").read_text()


def test_batches_stream_into_the_same_files(captured, tmp_path, monkeypatch):
    """Streamed a row at a time, each format holds what one batch gives: the same lines, the same rows (a Parquet row
    group per batch), verl's task prompts from the second pass with their indexes and counts."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for fmt, name in (("openai", "a.jsonl"), ("hf", "hf"), ("verl", "verl")):
        whole, streamed = tmp_path / "whole" / name, tmp_path / "streamed" / name
        one = export(captured, format=fmt, out=whole)
        many = export(captured, format=fmt, out=streamed, batch_rows=1)
        assert one == ExportReport(**{**vars(many), "out": str(whole)}), fmt
        assert _all_text(whole) == _all_text(streamed), fmt
    assert pq.ParquetFile(tmp_path / "streamed/hf" / HF_DATA_FILE).num_row_groups == 5
    assert pq.ParquetFile(tmp_path / "whole/hf" / HF_DATA_FILE).num_row_groups == 1
    rl = pq.read_table(tmp_path / "streamed/verl/rl.parquet").to_pylist()
    assert [(r["extra_info"]["index"], r["extra_info"]["task_id"], r["extra_info"]["episodes"]) for r in rl] == [
        (0, "mul-1", 2),
        (1, "hello", 1),
        (2, "mul-2", 1),
        (3, "mul-4", 1),
    ]
    ds = datasets.load_dataset(str(tmp_path / "streamed/hf"), cache_dir=str(tmp_path / "cache"))["train"]
    assert ds.num_rows == 5


def test_nothing_exported_leaves_no_folder(captured, tmp_path):
    for fmt in ("hf", "verl"):
        with pytest.raises(LcapError, match="nothing exported: 0 episodes chosen"):
            export(captured, format=fmt, out=tmp_path / "new" / fmt, where="reward > 5")
    assert not (tmp_path / "new").exists()


def _role_calls(role: str, system: dict, ids: list[int], questions: list[str]) -> list[dict]:
    """One role's chat calls, each prompt extending the one before with the answer and a user message."""
    messages, calls = [system], []
    for k, (turn, question) in enumerate(zip(chat_turns(*[[i] for i in ids]), questions, strict=True)):
        messages = [*messages, {"role": "user", "content": question}]
        answer = f"{role} {k}"
        calls.append(
            {**turn, "role": role, "request": {"model": "policy", "messages": messages}, "completion_text": answer}
        )
        messages = [*messages, {"role": "assistant", "content": answer}]
    return calls


@pytest.fixture
def two_roles(builder, dstore):
    """Episode `roles` (task plan-1): a planner's two calls and a solver's two, interleaved, each role's conversation
    stitching into one sample of its own; the planner called first."""
    planner = _role_calls("planner", {"role": "system", "content": "You plan."}, [10, 11], ["Plan 2+3.", "And?"])
    solver = _role_calls("solver", {"role": "system", "content": "You solve."}, [20, 21], ["Solve 2+3.", "Sure?"])
    solver[0]["prompt_token_ids"] = [4, 5]  # the solver's own system prompt
    solver[1]["prompt_token_ids"] = [4, 5, 20, 90, 91]
    builder.episode("roles", task="plan-1", reward=1.0, turns=_stored([planner[0], solver[0], planner[1], solver[1]]))
    return dstore


def test_an_episode_of_two_roles_exports_a_conversation_per_role(two_roles, tmp_path, monkeypatch):
    """Each role's conversation, the first to call first, with its own token ids; verl's task prompt is the first
    role's; a re-scoring verifier or judge gets every role's conversation, and as its one conversation the call
    that holds the most messages."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    report = export(two_roles, format="hf", out=tmp_path / "hf")
    assert (report.episodes, report.exported, report.conversations, report.with_token_ids) == (1, 1, 2, 2)
    assert "exported 1 of 1 episodes (2 conversations: one per role) as hf, 2 with token ids" in report.line()
    rows = datasets.load_dataset(str(tmp_path / "hf"), cache_dir=str(tmp_path / "cache"))["train"].to_list()
    assert [(r["episode_id"], r["role"]) for r in rows] == [("roles", "planner"), ("roles", "solver")]
    planner, solver = rows
    assert [m["content"] for m in planner["messages"]] == ["You plan.", "Plan 2+3.", "planner 0", "And?", "planner 1"]
    assert [m["content"] for m in solver["messages"]] == ["You solve.", "Solve 2+3.", "solver 0", "Sure?", "solver 1"]
    assert planner["completion_ids"] == [10, 90, 91, 11] and planner["loss_mask"] == [1, 0, 0, 1]
    assert solver["prompt_ids"] == [4, 5] and solver["completion_ids"] == [20, 90, 91, 21]

    lines = [json.loads(line) for line in _exported(two_roles, tmp_path / "roles.jsonl").splitlines()]
    assert [line["messages"][0]["content"] for line in lines] == ["You plan.", "You solve."]

    export(two_roles, format="verl", out=tmp_path / "verl")
    assert pq.read_table(tmp_path / "verl" / "sft.parquet").column("role").to_pylist() == ["planner", "solver"]
    (task,) = pq.read_table(tmp_path / "verl" / "rl.parquet").to_pylist()
    assert [m["content"] for m in task["prompt"]] == ["You plan.", "Plan 2+3."] and task["extra_info"]["episodes"] == 1

    with two_roles.connect(read_only=True) as con:
        said = transcripts(con, ["roles"])["roles"]
    assert [(r["role"], r["messages"][-1]["content"]) for r in said["roles"]] == [
        ("planner", "planner 1"),
        ("solver", "solver 1"),
    ]
    assert said["messages"] == said["roles"][1]["messages"]  # of equal length, the later call


def _exported(store, out: Path) -> str:
    export(store, format="openai", out=out)
    return out.read_text()


def test_a_roles_sft_samples_carry_that_roles_conversation(two_roles, tmp_path):
    """build-dataset --format sft --role R: each sample's conversation beside its ids is R's, as export writes it."""
    from lcap.dataset.build.builder import BuildOptions, build_dataset

    for role, system in (("planner", "You plan."), ("solver", "You solve.")):
        out = tmp_path / role
        build_dataset(two_roles, round=None, out=out, options=BuildOptions(format="sft", where="true"), role=role)
        (sample,) = pq.read_table(out / "samples.parquet").to_pylist()
        assert sample["messages"][0]["content"] == system and sample["messages"][-1]["content"] == f"{role} 1"
