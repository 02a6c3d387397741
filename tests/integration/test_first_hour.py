"""What a newcomer with their own agent hit in the first hour (issue #38): a loop that would supersede a manual
round, a placeholder API key, a crashing verifier's traceback, refused rounds and deploys, a Python-only doctor,
help that cuts flag names. Real stores, the real CLI, a stub upstream."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lcap.config import LcapError
from lcap.store import Store

LCAP = str(Path(sys.executable).parent / "lcap")

AGENT = """
import sys
from openai import OpenAI
OpenAI(max_retries=0, timeout=30).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
"""


def _collect(env: dict[str, str], cwd: Path, upstream: str, *args: str) -> subprocess.CompletedProcess:
    (cwd / "agent.py").write_text(AGENT)
    tasks = cwd / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t0"}) + "\n")
    return subprocess.run(
        [LCAP, "collect", "--tasks", str(tasks), "-g", "2", "--upstream", upstream, *args]
        + ["--", sys.executable, "agent.py"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_collect_refuses_a_round_another_collect_holds(capture_env, llm, tmp_path):
    """`lcap collect` itself: the same collect again resumes; another collect of the round is refused, saying how
    many episodes it would supersede, unless --replace."""
    verifier = ("--verifier", f"{sys.executable} -c 'print(1)'")
    first = _collect(capture_env, tmp_path, llm.url, "--round", "1", *verifier)
    assert first.returncode == 0, first.stderr
    store = Store(capture_env["LCAP_DB"])
    ((run_id,),) = store.fetchall("SELECT DISTINCT collect_run FROM episode_summary")

    again = _collect(capture_env, tmp_path, llm.url, "--round", "1", *verifier)  # the same collect: a resume
    assert again.returncode == 0, again.stderr
    assert "2 skipped (already done)" in again.stdout

    other = ("--verifier", f"{sys.executable} -c 'print(0)'")  # another verifier: another collect
    refused = _collect(capture_env, tmp_path, llm.url, "--round", "1", *other)
    line = _error(refused)
    assert line.startswith(
        f"lcap: round 1 (train) already has 2 episodes of another collect in this store (collect {run_id}): collect "
    )
    assert line.endswith(
        "would supersede them and the round would mix two runs; collect into a store of its own "
        "(--db), or add --replace to supersede them"
    )
    assert store.fetchall("SELECT count(*) FROM episodes")[0][0] == 2  # nothing ran

    replaced = _collect(capture_env, tmp_path, llm.url, "--round", "1", "--replace", *other)
    assert replaced.returncode == 0, replaced.stderr
    assert f"round 1 (train) already has 2 episodes of another collect in this store (collect {run_id}): " in (
        replaced.stdout
    )
    assert "supersedes them (--replace)" in replaced.stdout
    assert store.fetchall("SELECT count(*) FROM episodes WHERE round = 1")[0][0] == 4


def test_the_loop_refuses_a_round_a_manual_collect_already_holds(capture_env, llm, tmp_path):
    from lcap.dataset.collect.episodes import check_round_is_free
    from lcap.loop.steps import LoopConfig, collect_split

    manual = _collect(capture_env, tmp_path, llm.url, "--round", "1", "--verifier", f"{sys.executable} -c 'print(1)'")
    assert manual.returncode == 0, manual.stderr
    store = Store(capture_env["LCAP_DB"])
    ((count, run_id),) = store.fetchall("SELECT count(*), any_value(collect_run) FROM episode_summary")
    assert count == 2

    config = LoopConfig(run=tmp_path / "run", rounds=2, tasks=tmp_path / "tasks.jsonl", command=["./my-agent"])
    with pytest.raises(LcapError) as refused:
        collect_split(store, config, 1, "train", config.tasks, 2)
    assert str(refused.value).startswith(
        f"round 1 (train) already has 2 episodes of another collect in this store (collect {run_id}): collect "
    )
    assert str(refused.value).endswith("collect into a store of its own (--db), or add --replace to supersede them")
    assert store.fetchall("SELECT count(*) FROM episodes")[0][0] == 2  # nothing ran
    said: list[str] = []
    check_round_is_free(store, "other", 1, "train", replace=True, echo=said.append)  # asked: goes on, says so
    assert said == [
        f"round 1 (train) already has 2 episodes of another collect in this store (collect {run_id}): collect "
        "other supersedes them (--replace)"
    ]
    check_round_is_free(store, run_id, 1, "train")  # its own collect's episodes: a resume, no refusal
    check_round_is_free(store, "other", 2, "train")  # another round: free
    check_round_is_free(store, "other", 1, "eval")  # another split: free


def _lcap(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([LCAP, *args], env=env, capture_output=True, text=True, timeout=120)


def _error(done) -> str:
    """The one error line of a refused command (a finished process, or a CliRunner result)."""
    code = done.returncode if isinstance(done, subprocess.CompletedProcess) else done.exit_code
    assert code == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def _cli(*args: str):
    """`lcap ARGS` in this process (the refusals come before anything starts)."""
    from typer.testing import CliRunner

    from lcap.cli import app

    return CliRunner().invoke(app, list(args))


def test_rounds_that_exist_nowhere_are_refused(tmp_path, monkeypatch):
    from fixtures_dataset import StoreBuilder

    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))  # no policy server here
    db = tmp_path / "lcap.duckdb"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t"}\n')
    assert _error(_cli("collect", "--tasks", str(tasks), "--round", "-1", "--db", str(db), "--", "true")) == (
        "lcap: --round must be 0 or more, not -1 (round N trains on round N's episodes)"
    )

    run = tmp_path / "run"
    trained = _cli("train", "--round", "2", "--run", str(run), "--data", str(tmp_path), "--model", "unused")
    assert _error(trained) == (
        f"lcap: round 2 continues round 1's policy, and {run / 'round-1'} has no adapter or checkpoint: train "
        "round 1 first, or train these samples as --round 1 of a new --run"
    )

    missing = tmp_path / "run" / "round-1" / "adapter"
    assert _error(_cli("deploy", str(missing), "--db", str(db))) == (
        f"lcap: {missing} does not exist: deploy a round's adapter or checkpoint (RUN/round-N/adapter)"
    )
    adapter = tmp_path / "run" / "round-2" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    assert _error(_cli("deploy", str(adapter), "--round", "7", "--db", str(db))) == (
        f"lcap: {adapter} is in round-2: it is that round's output, not round 7's (--round)"
    )
    loose = tmp_path / "mine"
    loose.mkdir()
    (loose / "adapter_config.json").write_text("{}")
    assert _error(_cli("deploy", str(loose), "--round", "7", "--db", str(db))) == (
        "lcap: no round 7 anywhere: the store has no episode, training run or deployment of round 7; pass the round "
        "that trained it, or leave --round out"
    )
    assert _error(_cli("deploy", str(loose), "--round", "0", "--db", str(db))).startswith(
        "lcap: --round must be 1 or more"
    )
    StoreBuilder(Store(db)).episode("e7", round=7, reward=1.0)
    known = _cli("deploy", str(loose), "--round", "7", "--db", str(db))  # round 7 exists: on to the deploy itself
    assert _error(known).startswith("lcap: no policy server is running")
    assert _error(_cli("deploy", str(adapter), "--round", "2", "--db", str(db))).startswith(
        "lcap: no policy server is running"
    )
    assert Store(db).fetchall("SELECT count(*) FROM deployments")[0][0] == 0


CRASHING_AGENT = """
import sys
print("Traceback (most recent call last):\\n" + "  File 'agent.py', line 3, in <module>\\n" * 8, file=sys.stderr)
print("openai.OpenAIError: Missing credentials. Please pass an `api_key`", file=sys.stderr)
sys.exit(1)
"""


def test_an_agent_without_an_api_key_runs_and_a_crash_before_any_call_says_why(capture_env, llm, tmp_path):
    """An openai SDK agent with no OPENAI_API_KEY gets lcap's placeholder (lcap sends the upstream its own); an agent
    that dies before any call is told so, with the end of its traceback, not a proxy-settings hint."""
    env = {k: v for k, v in capture_env.items() if k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")}
    done = _collect(env, tmp_path, llm.url, "--round", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ok, 0 failed" in done.stdout and "turns per episode: min 1, median 1, max 1" in done.stdout

    (tmp_path / "crash.py").write_text(CRASHING_AGENT)
    crashed = subprocess.run(
        [LCAP, "collect", "--tasks", str(tmp_path / "tasks.jsonl"), "-g", "1", "--round", "2", "--upstream", llm.url]
        + ["--", sys.executable, "crash.py"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = crashed.stdout.splitlines()
    assert (
        "  1 episode with 0 turns, none finished ok: the agent ended before any LLM call through lcap: see the "
        "failures below" in lines
    ), lines
    (reason,) = [line for line in lines if line.startswith("    1 x agent exited 1: ")]
    assert reason.endswith("openai.OpenAIError: Missing credentials. Please pass an `api_key`"), reason


def test_help_read_through_a_pipe_keeps_every_flag_name_whole():
    env = {k: v for k, v in os.environ.items() if k not in ("TERMINAL_WIDTH", "COLUMNS")}
    done = _lcap("loop", "--help", env=env)
    assert done.returncode == 0, done.stderr
    assert "--eval-group-size" in done.stdout and "--tasks-per-round" in done.stdout
    assert "--keep-zero-variance" in done.stdout and "--episode-resources" in done.stdout
    cut = [line for line in done.stdout.splitlines() if re.search(r"--[a-z-]+…", line)]
    assert not cut, cut


def test_serve_says_it_installs_vllm_before_it_starts_to(tmp_path, monkeypatch, capsys):
    """A new LCAP_HOME: the first thing `lcap serve` says is that it installs vLLM, where, how big, and how to do it
    ahead of time; the install itself (minutes, the network) is stopped at its first step here."""
    from lcap.serve import vllm_env

    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    steps: list[str] = []

    def first_step(cmd: list[str], what: str) -> None:
        steps.append(what)
        raise LcapError(f"stopped before: {what}")

    monkeypatch.setattr(vllm_env, "_run", first_step)
    with pytest.raises(LcapError, match="stopped before: create the venv"):
        vllm_env.ensure_vllm_env()
    said = capsys.readouterr().err.splitlines()
    assert said == [
        f"lcap: vLLM is not installed for lcap yet: installing it into {tmp_path / 'home' / 'vllm-venv'}, once "
        f"(~{vllm_env.INSTALL_SIZE}, minutes; `lcap setup vllm` does it ahead of time, `lcap serve --python PY` uses "
        "a Python that has vLLM)"
    ]
    assert steps == ["create the venv"]


def test_the_async_loop_refuses_such_a_round_too(tmp_path):
    """`lcap loop --async`: its producer plans each wave's collect and stops on a round another collect holds."""
    import threading
    from types import SimpleNamespace

    from fixtures_dataset import StoreBuilder

    from lcap.loop.options import LoopOptions
    from lcap.loop.overlap import Producer
    from lcap.loop.steps import LoopConfig

    store = Store(tmp_path / "lcap.duckdb")
    StoreBuilder(store).episode("manual", round=1, reward=1.0)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t0"}\n')
    config = LoopConfig(
        run=tmp_path / "run", rounds=2, tasks=tasks, command=["true"], options=LoopOptions(overlap=True)
    )
    pool = SimpleNamespace(store=store, stopping=threading.Event(), ended=threading.Condition(), submit=None)
    producer = Producer(config, pool, group_size=2, per_step=1, wasted=0)
    producer._run()
    assert isinstance(producer.error, LcapError)
    assert str(producer.error).startswith("round 1 (train) already has 1 episodes of another collect in this store")


def test_a_loop_whose_adapters_the_server_cannot_load_is_refused_before_it_collects(tmp_path, monkeypatch):
    """A round's LoRA of a rank above the server's `--max-lora-rank` would train and then fail to deploy: the loop
    says so before its first collect."""
    from fixtures_vllm import record_dead_server

    from lcap.serve.vllm_process import MAX_LORA_RANK

    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    record_dead_server(pid=os.getpid())
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t"}\n')
    db = tmp_path / "lcap.duckdb"
    args = ["loop", "--tasks", str(tasks), "--run", str(tmp_path / "run"), "--rounds", "1", "--db", str(db)]
    refused = _cli(*args, "--lora-r", str(2 * MAX_LORA_RANK), "--", "true")
    assert _error(refused) == (
        f"lcap: --lora-r has rank {2 * MAX_LORA_RANK}; the server allows at most {MAX_LORA_RANK} "
        f"(restart it with `lcap serve ... -- --max-lora-rank {2 * MAX_LORA_RANK}`)"
    )
    assert not db.exists() or Store(db).fetchall("SELECT count(*) FROM episodes") == [(0,)]
