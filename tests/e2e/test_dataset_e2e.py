"""End to end on the real policy: bundled openai-SDK agents (plain scripts calling api.openai.com)
run by `collect` through the in-process capture proxy, rerouted to the real vLLM CPU server on
the tiny model; verifiers reward them; build-dataset turns the captured token ids into samples."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures_dataset import DATASET_VERIFIERS, py_agent

from lcap.dataset.build.builder import BuildOptions, build_dataset
from lcap.dataset.collect.episodes import collect_episodes
from lcap.dataset.options import CollectOptions
from lcap.store import Store

pytestmark = pytest.mark.vllm


def _tasks(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _collect(
    store: Store,
    tasks: Path,
    command: list[str],
    *,
    group_size: int,
    round: int,
    verifier: str,
    protect: tuple[str, ...] = (),
):
    """Collect on the served policy, a whole group at once."""
    options = CollectOptions(
        group_size=group_size,
        concurrency=group_size,
        round=round,
        upstream="policy",
        timeout=180,
        verifier=verifier,
        protect=protect,
    )
    return collect_episodes(store, tasks=tasks, command=command, options=options)


def _turns(store: Store, episode_id: str) -> list[dict]:
    cur = store.fetchall(
        """SELECT seq, prompt_token_ids, completion_token_ids, completion_logprobs, token_source,
                                   model_served, deployment, finish_reason
                            FROM turns WHERE episode_id = ? ORDER BY seq""",
        [episode_id],
    )
    keys = ["seq", "prompt", "completion", "logprobs", "token_source", "model_served", "deployment", "finish_reason"]
    return [dict(zip(keys, row)) for row in cur]


def test_single_turn_agent_command_verifier_and_tamper_guard(vllm_server, openai_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = Store(tmp_path / "lcap.duckdb")
    tasks = _tasks(
        tmp_path / "tasks.jsonl",
        [
            {"id": "capital", "question": "What is the capital of France?", "write": "notes.txt=ok"},
            {"id": "planet", "question": "Name the largest planet.", "write": "notes.txt=ok"},
            {
                "id": "cheat",
                "question": "Make the tests pass.",
                "write": "tests/test_task.py=def test(): pass",
                "files": {"tests/test_task.py": "def test(): assert False\n"},
            },
        ],
    )
    command = [*py_agent("openai_single.py"), "--question", "{question}", "--write", "{write}", "--max-tokens", "12"]
    verifier = f"{sys.executable} {DATASET_VERIFIERS / 'brevity.py'}"
    result = _collect(store, tasks, command, group_size=3, round=1, verifier=verifier, protect=("tests/**",))
    assert (result.episodes, result.finished, result.failed) == (9, 9, 0), result.statuses
    assert result.tampered == 3

    rows = store.fetchall("""SELECT episode_id, task_id, status, n_turns, reward, reward_source, flags
                             FROM episode_summary ORDER BY episode_id""")
    assert len(rows) == 9
    for eid, task, status, n_turns, reward, source, flags in rows:
        assert status == "ok" and n_turns == 1
        if task == "cheat":
            assert (reward, source, flags) == (0.0, "tamper-guard", ["tampered"])
        else:
            assert source.endswith("brevity.py") and 0 < reward <= 1 and flags == []
            answer = (
                Path(store.fetchall("SELECT cwd FROM episodes WHERE episode_id = ?", [eid])[0][0]) / "answer.txt"
            ).read_text()
            assert reward == pytest.approx(1 / (1 + len(answer.split())))
        (turn,) = _turns(store, eid)
        assert turn["token_source"] == "vllm" and turn["model_served"] == vllm_server.served_model
        assert len(turn["completion"]) == len(turn["logprobs"]) > 0

    report = build_dataset(
        store, round=1, out=tmp_path / "data", options=BuildOptions(keep_zero_variance=True, truncated="mask")
    )
    samples = pq.read_table(tmp_path / "data" / "samples.parquet").to_pylist()
    assert len(samples) == 9 and report.episodes["tampered"] == 3 and report.groups["total"] == 3
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    for sample in samples:
        (turn,) = _turns(store, sample["episode_id"])
        assert sample["prompt_ids"] == turn["prompt"] and sample["completion_ids"] == turn["completion"]
        assert sample["logprobs"] == pytest.approx(turn["logprobs"], abs=1e-5)
        assert sample["env_mask"] == [0 if turn["finish_reason"] == "length" else 1] * len(turn["completion"])
        assert sample["deployment"] == turn["deployment"] and not sample["rebuilt"]
        assert sample["truncated"] == (turn["finish_reason"] == "length")
        question = {"capital": "capital of France", "planet": "largest planet", "cheat": "Make the tests"}
        assert question[sample["task_id"]] in tok.decode(sample["prompt_ids"])


def test_multi_turn_tool_agent_env_masks_merged_and_split(vllm_server, openai_env, tmp_path, monkeypatch):
    """Calls 0-1 extend each other (merged, tool/observation tokens masked); call 2 compacts the
    history so its prompt no longer extends call 1 (a new sample), and call 3 extends call 2."""
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    tok = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    store = Store(tmp_path / "lcap.duckdb")
    tasks = _tasks(tmp_path / "tasks.jsonl", [{"id": "france", "question": "What is the capital of France?"}])
    # the bias makes the model end its turn at once: its completion re-renders to the same tokens
    command = [*py_agent("openai_tools.py"), "--question", "{question}", "--turns", "4", "--compact-at", "2"]
    command += ["--logit-bias", json.dumps({str(end): 100})]
    verifier = f"{DATASET_VERIFIERS / 'python_verifiers.py'}:answer_length"
    result = _collect(store, tasks, command, group_size=2, round=2, verifier=verifier)
    assert result.finished == 2, result.statuses
    assert store.fetchall("SELECT DISTINCT reward_source FROM episode_summary") == [
        (f"{DATASET_VERIFIERS / 'python_verifiers.py'}:answer_length",)
    ]

    report = build_dataset(store, round=2, out=tmp_path / "data", options=BuildOptions(keep_zero_variance=True))
    samples = pq.read_table(tmp_path / "data" / "samples.parquet").to_pylist()
    assert len(samples) == 4 and report.sample_counts["merged"] == 4 and report.sample_counts["episodes_split"] == 2
    for episode in {s["episode_id"] for s in samples}:
        turns = _turns(store, episode)
        assert [t["seq"] for t in turns] == [0, 1, 2, 3] and all(t["token_source"] == "vllm" for t in turns)
        first, second = sorted((s for s in samples if s["episode_id"] == episode), key=lambda s: s["sample_id"])
        for sample, (a, b) in ((first, turns[0:2]), (second, turns[2:4])):
            # the second call's prompt starts with the first call's prompt + completion, on token ids
            cut = len(a["prompt"]) + len(a["completion"])
            assert b["prompt"][:cut] == a["prompt"] + a["completion"]
            env = b["prompt"][cut:]
            assert sample["prompt_ids"] == a["prompt"]
            assert sample["completion_ids"] == a["completion"] + env + b["completion"]
            assert sample["env_mask"] == [1] * len(a["completion"]) + [0] * len(env) + [1] * len(b["completion"])
            assert sample["logprobs"] == pytest.approx(a["logprobs"] + [0.0] * len(env) + b["logprobs"], abs=1e-5)
            assert (sample["n_turns"], sample["merged"]) == (2, True)
        # the masked tokens are the environment's: the observation the harness sent back
        env_text = tok.decode([t for t, m in zip(first["completion_ids"], first["env_mask"]) if m == 0])
        assert "Observation 0: Paris" in env_text and "<|im_start|>assistant" in env_text
        # call 2 rewrote the history: not a prefix of call 1's tokens, so it starts the second sample
        assert turns[2]["prompt"][: len(turns[1]["prompt"])] != turns[1]["prompt"]
        assert "Summary of 2 earlier steps" in tok.decode(second["prompt_ids"])
