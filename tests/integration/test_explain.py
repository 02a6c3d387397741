"""Errors that say what to do: every "nothing to train on" names the counts by cause (from build-dataset's report)
and the option or command that changes it, in build-dataset, train and loop; collect ends with a summary that
says where to look. Real stores, real build-dataset, the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_dataset import chat_turns, lost_samples_scenario

from lcap.config import LcapError
from lcap.dataset.build.builder import BuildOptions, build_dataset
from lcap.dataset.build.explain import NO_CALLS_FIX, causes, explain

LCAP = str(Path(sys.executable).parent / "lcap")


def _lcap(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([LCAP, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def _truncating_group(builder) -> None:
    """The issue's round: 8 episodes of 6 calls each asking for a few tokens; all calls but one hit the limit."""
    for i in range(8):
        turns = chat_turns(*[[10 + i, 11 + k] for k in range(6)])
        for turn in turns:
            turn["finish_reason"] = "length"
        if i == 0:
            turns[-1]["finish_reason"] = "stop"
        builder.episode(f"ep{i}", sample=i, reward=float(i % 2), turns=turns)


def test_truncated_calls_explained_by_build_train_and_the_fix_works(builder, dstore, tmp_path):
    _truncating_group(builder)
    out = tmp_path / "data"
    report = build_dataset(dstore, round=1, out=out)
    assert report.samples == 1 and report.groups["trainable"] == 0
    line = explain(report)
    assert "47 of 48 calls hit the token limit and their 47 samples were dropped (--truncated drop)" in line
    assert "build with --truncated mask, or raise the agent's max_tokens" in line

    built = _lcap("build-dataset", "--round", "1", "--out", str(tmp_path / "cli"), "--db", str(dstore.path))
    assert built.returncode == 0, built.stderr
    warning = built.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("lcap: warning: round 1 has no group of two or more samples")
    assert "47 of 48 calls hit the token limit" in warning[0] and "--truncated mask" in warning[0]

    trained = _lcap("train", "--round", "1", "--run", str(tmp_path / "run"), "--data", str(out), "--model", "unused")
    assert trained.returncode == 2, trained.stdout + trained.stderr
    (error,) = trained.stderr.strip().splitlines()
    assert error.startswith(f"lcap: round 1: no group with two or more usable samples in {out / 'samples.parquet'}")
    assert "(1 sample in 1 group)" in error
    assert "47 of 48 calls hit the token limit and their 47 samples were dropped (--truncated drop)" in error
    assert "build with --truncated mask" in error
    assert "1 sample is alone in its group" in error

    # the suggested option: every call is kept (masked), and the group trains
    masked = build_dataset(dstore, round=1, out=tmp_path / "masked", options=BuildOptions(truncated="mask"))
    assert masked.samples == 48 and masked.groups["trainable"] == 1
    assert not any("token limit" in str(c) for c in causes(masked))


def test_build_dataset_cli_exits_2_with_the_reason_when_nothing_is_left(builder, dstore, tmp_path):
    lost_samples_scenario(builder, "no_reward")
    done = _lcap("build-dataset", "--round", "1", "--out", str(tmp_path / "d"), "--db", str(dstore.path))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("lcap: round 1: nothing to train on: 2 of 2 finished episodes have no reward")
    assert "round 1 (train): 0 samples" in done.stdout  # the report is still printed, not written (#51 row 5)
    assert not (tmp_path / "d").exists()


def test_build_dataset_cli_says_what_was_lost_when_some_samples_remain(builder, dstore, tmp_path):
    builder.episode("a", sample=0, reward=1.0, turns=chat_turns([5, 2]))
    builder.episode("b", sample=1, reward=0.0, turns=chat_turns([6, 2]))
    builder.episode("c", sample=2, status="timeout", turns=chat_turns([7, 2]))
    done = _lcap("build-dataset", "--round", "1", "--out", str(tmp_path / "d"), "--db", str(dstore.path))
    assert done.returncode == 0, done.stderr
    lost = [line for line in done.stdout.splitlines() if line.startswith("lost: ")]
    assert lost == [
        "lost: 1 of 3 episodes did not finish ok: 1 timed out; see each one's reason in its stderr.txt or "
        "`lcap sql \"select episode_id, status, error from episodes where status <> 'ok'\"`; raise --timeout"
    ]


COLLECT_AGENT = """
import sys
mode, sample = sys.argv[1], sys.argv[2]
if mode == "fail":
    print(f"boom at step {sample}", file=sys.stderr)
    sys.exit(3)
if mode == "call":
    from openai import OpenAI
    OpenAI(max_retries=0, timeout=30).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
"""


def test_collect_ends_with_a_summary_that_says_where_to_look(capture_env, llm, tmp_path):
    (tmp_path / "agent.py").write_text(COLLECT_AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": m, "mode": m}) + "\n" for m in ("call", "fail", "silent")))
    done = subprocess.run(
        [LCAP, "collect", "--tasks", str(tasks), "-g", "2", "--round", "1", "--upstream", llm.url]
        + ["--verifier", f"{sys.executable} -c 'print(1.0)'", "--", sys.executable, "agent.py", "{mode}", "{sample}"],
        env=capture_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "  episodes: ok 4, failed 2" in lines
    assert "  reward: mean 1.000 over 4 rewarded episodes" in lines
    assert "  turns per episode: min 0, median 0, max 1" in lines
    assert (
        f"  4 episodes with 0 turns (2 of them finished ok): the agent made no LLM call through lcap: {NO_CALLS_FIX}"
        in lines
    )
    i = lines.index("  failures, most common first:")
    assert lines[i + 1] == "    2 x agent exited 3: boom at step 0"  # one reason, whatever the numbers in it
    example = lines[i + 2].strip().removeprefix("e.g. ")
    assert example.endswith("stderr.txt") and "boom at step 0" in (tmp_path / example).read_text()


def test_collect_groups_failures_by_reason_whatever_task_fields_they_quote(capture_env, tmp_path):
    """An agent's usage error quotes its task's word: the failures are one reason, the word read as `{word}` (#51 row
    12: one line per task before)."""
    (tmp_path / "agent.py").write_text(
        "import sys\nprint('no such word:', *sys.argv[1:], file=sys.stderr)\nsys.exit(2)\n"
    )
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "word": w}) + "\n" for i, w in enumerate(("button", "rabbit"))))
    done = subprocess.run(
        [LCAP, "collect", "--tasks", str(tasks), "-g", "1", "--upstream", "none"]
        + ["--", sys.executable, "agent.py", "--word", "{word}"],
        env=capture_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stdout.splitlines()
    i = lines.index("  failures, most common first:")
    assert lines[i + 1] == "    2 x agent exited 2: no such word: --word {word}", lines
    assert ": 2 episodes, 0 ok, 2 failed, 0 skipped" in lines[0], lines[0]


def test_collect_failure_reasons_are_text_not_markup(tmp_path, monkeypatch, capsys):
    """An agent's stderr with rich markup and ANSI escapes is printed as it is (escaped), and never breaks collect."""
    from lcap.dataset.collect.episodes import collect_episodes
    from lcap.dataset.options import CollectOptions
    from lcap.store import Store

    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent.py").write_text("import sys\nprint('[/bold] \\x1b[31mred', file=sys.stderr)\nsys.exit(1)\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t"}\n')
    result = collect_episodes(
        Store(tmp_path / "lcap.duckdb"),
        tasks=tasks,
        command=[sys.executable, "agent.py"],
        options=CollectOptions(group_size=1, upstream=None),
        progress=True,
    )
    assert result.statuses == {"failed": 1}
    assert result.summary is not None
    assert result.summary.reasons[0].text == "agent exited 1: [/bold] \x1b[31mred"
    assert "failed agent exited 1: [/bold] \\x1b[31mred" in capsys.readouterr().err


def test_a_round_whose_every_token_is_masked_is_refused_with_its_causes(builder, dstore, tmp_path):
    """The issue's round 2: every call hit the token limit, built with --truncated mask: no trainable token. train
    (and the loop's train step) refuse it before loading any model, naming the cause, its count and the flag."""
    for i in range(8):
        turns = chat_turns([10 + i, 11])
        turns[0]["finish_reason"] = "length"
        builder.episode(f"ep{i}", sample=i, reward=float(i % 2), turns=turns)
    out = tmp_path / "data"
    report = build_dataset(dstore, round=1, out=out, options=BuildOptions(truncated="mask"))
    assert report.samples == 8 and report.groups["trainable"] == 1

    trained = _lcap("train", "--round", "1", "--run", str(tmp_path / "run"), "--data", str(out), "--model", "unused")
    assert trained.returncode == 2, trained.stdout + trained.stderr
    (error,) = trained.stderr.strip().splitlines()
    assert error.startswith("lcap: round 1: not trained: 0 trainable tokens, fewer than --min-tokens 1: ")
    assert (
        "8 of 8 samples hit the token limit and every token of theirs is masked (build-dataset --truncated mask); "
        "raise the agent's max_tokens" in error
    )
    assert "--min-tokens N changes the minimum" in error
    assert not (tmp_path / "run" / "round-1" / "adapter").exists()

    from lcap.loop.steps import train_step
    from lcap.train.options import TrainOptions

    with pytest.raises(LcapError, match="round 1: not trained: 0 trainable tokens"):
        train_step(dstore, tmp_path / "loop-run", 1, TrainOptions(base_model="unused"), out)
    assert dstore.fetchall("SELECT count(*) FROM deployments")[0][0] == 0


def test_collect_exits_1_when_no_episode_finished_ok(capture_env, llm, tmp_path):
    (tmp_path / "agent.py").write_text(COLLECT_AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "f", "mode": "fail"}) + "\n")
    command = [LCAP, "collect", "--tasks", str(tasks), "-g", "2", "--round", "1", "--upstream", llm.url]
    done = subprocess.run(
        command + ["--", sys.executable, "agent.py", "{mode}", "{sample}"],
        env=capture_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "0 ok, 2 failed" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        "lcap: collect: no episode of this run finished ok (2 failed): see the failures above"
    )


def test_train_and_the_loop_say_what_build_dataset_lost(builder, dstore, tmp_path):
    """2 of 3 groups got the same reward for every sample: build-dataset, train and the loop each print `lost:`."""
    from lcap.loop.rounds import _rounds
    from lcap.loop.steps import LoopConfig, LoopState, StepRunner
    from lcap.train.options import TrainOptions

    for g, rewards in enumerate(((1.0, 0.0), (1.0, 1.0), (0.0, 0.0))):
        for k, reward in enumerate(rewards):
            builder.episode(f"g{g}-{k}", task=f"t{g}", sample=k, reward=reward, turns=chat_turns([5 + k, 2]))
    run = tmp_path / "run"
    data = run / "round-1" / "data"
    built = _lcap("build-dataset", "--round", "1", "--out", str(data), "--db", str(dstore.path))
    lost = [line for line in built.stdout.splitlines() if line.startswith("lost: ")]
    assert len(lost) == 1 and lost[0].startswith("lost: 2 of 3 groups got the same reward for every sample")

    # --min-tokens stops each before any model loads: what they print first is the point here
    trained = _lcap("train", "--round", "1", "--run", str(run), "--model", "unused", "--min-tokens", "1000")
    assert trained.returncode == 2 and "fewer than --min-tokens 1000" in trained.stderr
    assert [line for line in trained.stdout.splitlines() if line.startswith("lost: ")] == lost

    config = LoopConfig(
        run=run, rounds=1, tasks=tmp_path / "tasks.jsonl", command=["agent"], train=TrainOptions(min_tokens=1000)
    )
    state = LoopState(run, config.key())
    state.finish(1, "collect", {"mean_reward": 0.5, "rewarded": 6})  # collected (by the builder above)
    said: list[str] = []
    _rounds(dstore, config, StepRunner(dstore, state, run), said.append, None)  # a loop skips such a round (#53)
    assert any("fewer than --min-tokens 1000" in line for line in said), said
    assert [line for line in said if line.startswith("lost: ")] == lost


CRASHING_VERIFIER = """
def judge(ctx):
    return helper(ctx)

def helper(ctx):
    raise KeyError("expected_answer")
"""


def test_a_crashing_verifier_is_shown_its_own_traceback(capture_env, llm, tmp_path):
    """The summary's example for a verifier's error is its verifier.txt (the whole traceback), not the agent's empty
    stderr.txt (a command verifier's output: tests/integration/test_dataset_verifiers.py)."""
    (tmp_path / "agent.py").write_text(COLLECT_AGENT)
    (tmp_path / "judge.py").write_text(CRASHING_VERIFIER)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "c", "mode": "call"}) + "\n")
    done = subprocess.run(
        [LCAP, "collect", "--tasks", str(tasks), "-g", "1", "--round", "1", "--upstream", llm.url]
        + ["--verifier", "judge.py:judge", "--", sys.executable, "agent.py", "{mode}", "{sample}"],
        env=capture_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stdout.splitlines()
    # the head line and the summary's status line name the same status (#51 row 6: "1 failed" against "error 1")
    assert ": 1 episodes, 0 ok, 1 error, 0 skipped (already done)" in lines[0], lines[0]
    assert "  episodes: error 1" in lines
    i = lines.index("  failures, most common first:")
    assert lines[i + 1].startswith("    1 x verifier: judge.py:judge raised KeyError"), lines
    example = lines[i + 2].strip().removeprefix("e.g. ")
    assert example.endswith("verifier.txt"), example
    assert "in helper" in (tmp_path / example).read_text()
    assert (tmp_path / example).with_name("stderr.txt").read_text() == ""  # the agent said nothing
