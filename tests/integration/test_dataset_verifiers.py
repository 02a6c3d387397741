"""Verifiers (command and Python), the tamper guard's hashing, task files and command templates."""

from __future__ import annotations

import sys

import pytest
from fixtures_dataset import DATASET_VERIFIERS, verifier_context

from lcap.dataset.collect.verifiers import VerifierError, load_verifier


def test_command_verifier_reads_task_stdout_and_workdir(tmp_path):
    verdict = load_verifier(f"{sys.executable} {DATASET_VERIFIERS / 'contains_answer.py'}")(
        verifier_context(tmp_path, "It is paris, I think.")
    )
    assert verdict.reward == 1.0 and verdict.details == {"expected": "Paris", "output_chars": 21}
    assert (
        load_verifier(f"{sys.executable} {DATASET_VERIFIERS / 'contains_answer.py'}")(
            verifier_context(tmp_path, "Rome")
        ).reward
        == 0.0
    )
    ctx = verifier_context(tmp_path)
    (ctx.workdir / "answer.txt").write_text("one two three")
    assert load_verifier(f"{sys.executable} {DATASET_VERIFIERS / 'brevity.py'}")(ctx).reward == 0.25


def test_command_verifier_sees_its_environment(tmp_path):
    script = tmp_path / "v.py"
    script.write_text(
        "import os, json, sys\n"
        "print('noise')\n"
        "print(json.dumps({'reward': 0.5, 'ep': os.environ['LCAP_EPISODE_ID'], 'cwd': os.getcwd(),"
        " 'task': json.loads(os.environ['LCAP_TASK'])['id'], 'stdin': sys.stdin.read(),"
        " 'file': open(os.environ['LCAP_AGENT_STDOUT']).read()}))\n"
    )
    ctx = verifier_context(tmp_path, "agent says hi")
    verdict = load_verifier(f"{sys.executable} v.py", base=tmp_path)(ctx)  # relative script path resolved
    assert verdict.reward == 0.5
    assert verdict.details == {
        "ep": "ep-1",
        "cwd": str(ctx.workdir),
        "task": "t1",
        "stdin": "agent says hi",
        "file": "agent says hi",
    }


@pytest.mark.parametrize(
    "code, message",
    [
        ("import sys; sys.exit(3)", "verifier exited 3"),
        ("print('not a number')", "not a float or JSON"),
        ("pass", "printed nothing"),
        ("import json; print(json.dumps(dict(score=1)))", "without 'reward'"),
        ("print('NaN')", "non-finite"),
    ],
)
def test_command_verifier_errors(tmp_path, code, message):
    with pytest.raises(VerifierError, match=message):
        load_verifier(f'{sys.executable} -c "{code}"')(verifier_context(tmp_path))


def test_a_verifier_error_carries_all_the_verifier_said(tmp_path):
    """What collect writes to the episode's verifier.txt: a command's whole stderr and stdout (its message keeps only
    a tail), a Python verifier's traceback."""
    lines = "".join(f"echo 'trace line {i}' >&2\n" for i in range(40))
    (tmp_path / "judge.sh").write_text(lines + "echo 'partial output'\nexit 4\n")
    (tmp_path / "judge.py").write_text(
        "def judge(ctx):\n    return helper(ctx)\n\ndef helper(ctx):\n    raise KeyError('x')\n"
    )
    ctx = verifier_context(tmp_path)
    with pytest.raises(VerifierError) as crashed:
        load_verifier(f"sh {tmp_path / 'judge.sh'}", base=tmp_path)(ctx)
    assert "trace line 0\n" in crashed.value.output and "trace line 39\n" in crashed.value.output
    assert "--- stdout\npartial output" in crashed.value.output and "trace line 0 " not in str(crashed.value)
    with pytest.raises(VerifierError) as raised:
        load_verifier("judge.py:judge", base=tmp_path)(ctx)
    assert "in helper" in raised.value.output and raised.value.output.rstrip().endswith("KeyError: 'x'")
