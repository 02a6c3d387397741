"""build-dataset --format sft: the policy's calls keep their captured ids, a teacher API's are re-rendered with the
student's template; conversations and the loss mask written; what re-rendering changed is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures_dataset import chat_turns

from lcap.dataset.build.builder import build_dataset
from lcap.dataset.build.samples_file import read_samples_table
from lcap.dataset.options import BuildOptions

SYSTEM = {"role": "system", "content": "You are a calculator agent."}
USER = {"role": "user", "content": "What is 17*25?"}
ARGS = '{"expr":"17*25"}'  # as the teacher wrote it: no space after the colon
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def _teacher_turns(answer: str) -> list[dict]:
    """Two calls a teacher API served (no deployment), with ids of the teacher's own tokenizer: a tool call, then
    the answer after the tool's result."""
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": ARGS}}
    first = [SYSTEM, USER]
    second = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "425"},
    ]
    common = {"deployment": None, "model_served": "teacher-xl", "token_source": "vllm"}
    return [
        dict(
            common,
            request=json.dumps({"messages": first, "tools": TOOLS}),
            completion_text="",
            tool_calls=json.dumps([{"id": "c1", "name": "calculator", "arguments": ARGS}]),
            prompt_token_ids=[900, 901],
            completion_token_ids=[902],
        ),
        dict(
            common,
            request=json.dumps({"messages": second, "tools": TOOLS}),
            completion_text=answer,
            prompt_token_ids=[900, 901, 902, 903],
            completion_token_ids=[904],
        ),
    ]


@pytest.fixture
def mixed(builder, dstore):
    """A policy episode (captured ids, deployment tiny) and a teacher's episode, both successful, and a teacher's
    failure that `--where "reward = 1"` leaves out."""
    policy = [dict(t, request=json.dumps({"messages": [USER]}), completion_text="x") for t in chat_turns([5, 6], [7])]
    builder.episode("policy", task="p", reward=1.0, turns=policy)
    builder.episode("teacher", task="t", reward=1.0, turns=_teacher_turns("17*25 = 425"))
    builder.episode("teacher-wrong", task="t", sample=1, reward=0.0, turns=_teacher_turns("17*25 = 400"))
    return dstore


def _sft(store, out: Path, tokenizer: Path):
    options = BuildOptions(format="sft", tokenizer=str(tokenizer), where="reward = 1")
    report = build_dataset(store, round=None, out=out, options=options)
    return report, {r["episode_id"]: r for r in pq.read_table(out / "samples.parquet").to_pylist()}


def test_policy_ids_kept_teacher_rerendered_with_the_students_template(mixed, tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    report, samples = _sft(mixed, tmp_path / "sft", tiny_model_dir)
    assert report.sft["turns"] == {"policy_captured": 2, "policy_rebuilt": 0, "teacher_rerendered": 2}
    assert report.turns["rebuilt_now"] == 2  # the chosen teacher calls only, not the failure's
    # zero-variance singleton groups are kept: supervised samples need no group
    assert set(samples) == {"policy", "teacher"} and report.samples == 2

    policy = samples["policy"]  # the captured ids as served, stitched: env tokens masked out of the loss
    assert policy["prompt_ids"] == [1, 2, 3] and policy["completion_ids"] == [5, 6, 90, 91, 7]
    assert policy["env_mask"] == [1, 1, 0, 0, 1] and policy["rebuilt"] is False

    teacher = samples["teacher"]  # never the teacher's own ids; the student's rendering, one sample when it stitches
    assert 900 not in teacher["prompt_ids"] + teacher["completion_ids"] and teacher["rebuilt"] is True
    messages = [SYSTEM, USER]
    assert (
        teacher["prompt_ids"]
        == tok(
            tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
    )
    assert teacher["n_turns"] == 2 and teacher["merged"] is True
    model_text = tok.decode([t for t, m in zip(teacher["completion_ids"], teacher["env_mask"]) if m])
    env_text = tok.decode([t for t, m in zip(teacher["completion_ids"], teacher["env_mask"]) if not m])
    assert ARGS in model_text and "17*25 = 425" in model_text and "425" in env_text and "17*25 = 425" not in env_text
    assert report.sft["rerender_changes"] == {"whitespace": 0, "tool JSON": 0, "text": 0, "turns": {}}

    # the conversation with its tools beside the ids, redacted as export writes it; the trainer's reader still reads
    assert [m["role"] for m in teacher["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert json.loads(teacher["tools"]) == TOOLS
    assert read_samples_table(tmp_path / "sft").num_rows == 2


def test_report_says_where_rerendering_changed_whitespace_or_tool_json(mixed, tmp_path, tiny_model_dir):
    """A student template that trims answers and re-serialises tool arguments (as many real ones do)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = tok.chat_template
    template = template.replace(
        "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}",
        "{%- if tool_call.arguments is string %}{{- tool_call.arguments | replace(':', ': ') }}{%- else %}",
    )
    template = template.replace(
        "'\\n' + render_content(message.content) + '<|im_end|>\\n'",
        "'\\n' + render_content(message.content) | trim + '<|im_end|>\\n'",
    )
    assert template != tok.chat_template
    tok.chat_template = template
    student = tmp_path / "student"
    tok.save_pretrained(student)
    mixed.append("turns", [dict(_teacher_turns("  425\n\n")[1], turn_id="teacher/9", episode_id="teacher", seq=9)])
    first, _ = _sft(mixed, tmp_path / "first", tiny_model_dir)
    assert first.sft["rerender_changes"]["tool JSON"] == 0 and first.turns["rebuilt_now"] == 3
    # another student: its own rendering, not the cached one of the first
    report, _ = _sft(mixed, tmp_path / "sft", student)
    assert report.turns["rebuilt_now"] == 3
    changes = report.sft["rerender_changes"]
    assert changes["tool JSON"] == 1 and changes["turns"]["tool JSON"] == ["teacher/0"]
    assert changes["whitespace"] == 1 and changes["turns"]["whitespace"] == ["teacher/9"]
    assert "re-rendering changed: whitespace 1, tool JSON 1, text 0" in "\n".join(report.lines())
