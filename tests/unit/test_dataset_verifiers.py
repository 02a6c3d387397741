"""Python verifiers, the tamper guard's hashing, task files and command templates (command verifiers as child
processes: tests/integration/test_dataset_verifiers.py)."""

from __future__ import annotations

import sys

import pytest
from fixtures_dataset import verifier_context

from lcap.config import LcapError
from lcap.dataset.collect.episodes import episode_id, load_tasks, render_command
from lcap.dataset.collect.verifiers import (
    VerifierError,
    hash_protected,
    load_verifier,
    resolve_argv,
    tampered_files,
    to_verdict,
)


def test_python_verifier_return_shapes_and_errors(tmp_path):
    module = tmp_path / "judge.py"
    module.write_text(
        "def pair(ctx): return 0.25, {'why': ctx.task_id}\n"
        "def mapping(ctx): return {'reward': True, 'n': len(ctx.stdout)}\n"
        "def boom(ctx): raise RuntimeError('bad judge')\n"
        "def text(ctx): return 'yes'\n"
        "boom.protected = ['tests/*.py']\n"
    )
    ctx = verifier_context(tmp_path, "abc")
    assert load_verifier("judge.py:pair", base=tmp_path)(ctx).details == {"why": "t1"}
    assert load_verifier("judge.py:mapping", base=tmp_path)(ctx).reward == 1.0
    boom = load_verifier("judge.py:boom", base=tmp_path)
    assert boom.protected == ("tests/*.py",)
    with pytest.raises(VerifierError, match="RuntimeError: bad judge"):
        boom(ctx)
    with pytest.raises(VerifierError, match="not a number"):
        load_verifier("judge.py:text", base=tmp_path)(ctx)
    assert load_verifier("judge:pair", base=tmp_path)(ctx).reward == 0.25  # module:function on the path
    with pytest.raises(LcapError, match="is not a function"):
        load_verifier("judge.py:missing", base=tmp_path)
    assert to_verdict(3).reward == 3.0


def test_tamper_hashes_detect_edit_add_delete(tmp_path):
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "test_a.py").write_text("assert 1")
    (tmp_path / "tests" / "sub" / "test_b.py").write_text("assert 2")
    (tmp_path / "src.py").write_text("x = 1")
    before = hash_protected(tmp_path, ["tests/**"])
    assert sorted(before) == ["tests/sub/test_b.py", "tests/test_a.py"]
    (tmp_path / "src.py").write_text("x = 2")  # not protected
    assert tampered_files(before, hash_protected(tmp_path, ["tests/**"])) == []
    (tmp_path / "tests" / "test_a.py").write_text("assert True")
    (tmp_path / "tests" / "sub" / "test_b.py").unlink()
    (tmp_path / "tests" / "conftest.py").write_text("")
    assert tampered_files(before, hash_protected(tmp_path, ["tests/**"])) == [
        "tests/conftest.py",
        "tests/sub/test_b.py",
        "tests/test_a.py",
    ]


def test_command_templates_and_episode_ids():
    task = {"id": "t/1", "question": 'it\'s "quoted"; rm -rf /', "n": 3, "meta": {"a": 1}}
    argv = render_command(["python", "agent.py", "--question", "{question}", "--n={n}", "{meta}"], task)
    assert argv == ["python", "agent.py", "--question", task["question"], "--n=3", '{"a": 1}']
    shell = render_command(["sh", "-c", "echo {question} > out.txt"], task)
    assert shell[2] == "echo 'it'\"'\"'s \"quoted\"; rm -rf /' > out.txt"
    with pytest.raises(LcapError, match=r"placeholder \{missing\}"):
        render_command(["x", "{missing}"], task)
    eid = episode_id("abcd1234", 2, "train", "t/1", 5)
    assert eid.startswith("cabcd1234-r2-train-t_1-") and eid.endswith("-5")
    assert eid == episode_id("abcd1234", 2, "train", "t/1", 5) != episode_id("abcd1234", 2, "eval", "t/1", 5)


def test_load_tasks_errors(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": 1, "q": "a"}\n\n{"id": "2"}\n')
    assert [t["id"] for t in load_tasks(path)] == ["1", "2"]
    for text, message in [
        ('{"q": 1}\n', "with an 'id'"),
        ('{"id": 1}\n{"id": "1"}\n', "duplicate task id"),
        ("{oops\n", "tasks.jsonl:1: not JSON"),
        ("\n", "no tasks"),
    ]:
        path.write_text(text)
        with pytest.raises(LcapError, match=message):
            load_tasks(path)
    with pytest.raises(LcapError, match="cannot read tasks"):
        load_tasks(tmp_path / "missing.jsonl")


def test_a_relative_venv_interpreter_is_made_absolute_without_leaving_the_venv(tmp_path):
    """`lcap collect -- .venv/bin/python agent.py`: each episode runs in its own folder, so the paths become absolute,
    but the venv's python stays the link it is (its target, run by its own path, would not see the venv's packages)."""
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "agent.py").write_text("print('hi')\n")
    argv = resolve_argv([".venv/bin/python", "./agent.py", "--flag", "{q}", "missing.py"], tmp_path)
    assert argv == [str(tmp_path / ".venv/bin/python"), str(tmp_path / "agent.py"), "--flag", "{q}", "missing.py"]
