"""build-dataset on real DuckDB stores: merge and env masks, advantages, each cleaning rule, views (the reward
command as a child process: tests/integration/test_dataset_build.py)."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures_dataset import chat_turns

from lcap.config import LcapError
from lcap.dataset.build.builder import BuildOptions, build_dataset
from lcap.dataset.build.explain import causes
from lcap.dataset.build.merge import merge_turns


def _build(store, tmp_path, **options):
    out = tmp_path / "data"
    report = build_dataset(store, round=1, out=out, options=BuildOptions(**options))
    rows = pq.read_table(out / "samples.parquet").to_pylist()
    return report, {r["sample_id"]: r for r in rows}, out


def _group(builder, task, rewards, *, prefix=None, **kw):
    """A healthy group: one single-call episode per reward."""
    prefix = prefix or task
    return [
        builder.episode(f"{prefix}-{i}", task=task, sample=i, reward=r, turns=chat_turns([10 + i, 11, 2]), **kw)
        for i, r in enumerate(rewards)
    ]


def test_multi_turn_merge_env_mask_and_split(builder, dstore, tmp_path):
    # calls 0 and 1 extend each other (merged); call 2's prompt rewrites history (split); call 3 extends call 2
    turns = chat_turns([40, 41, 2], [50, 2], env=[90, 91, 92])
    rewritten = [1, 2, 3, 77, 78]
    turns += [
        {"prompt_token_ids": rewritten, "completion_token_ids": [60, 2], "completion_logprobs": [-1.0, -2.0]},
        {"prompt_token_ids": rewritten + [60, 2, 93], "completion_token_ids": [70, 71, 2]},
    ]
    builder.episode("ep-a", sample=0, reward=1.0, turns=turns)
    builder.episode("ep-b", sample=1, reward=0.0, turns=chat_turns([5, 2]))
    report, samples, out = _build(dstore, tmp_path)

    first = samples["ep-a#0"]
    assert first["prompt_ids"] == [1, 2, 3]
    assert first["completion_ids"] == [40, 41, 2, 90, 91, 92, 50, 2]
    assert first["env_mask"] == [1, 1, 1, 0, 0, 0, 1, 1]
    assert first["logprobs"] == [-0.25, -0.25, -0.25, 0.0, 0.0, 0.0, -0.25, -0.25]
    assert (first["n_turns"], first["merged"]) == (2, True)
    second = samples["ep-a#1"]
    assert second["prompt_ids"] == rewritten
    assert second["completion_ids"] == [60, 2, 93, 70, 71, 2]
    assert second["env_mask"] == [1, 1, 0, 1, 1, 1]
    assert second["logprobs"][:3] == [-1.0, -2.0, 0.0]
    assert second["n_turns"] == 2 and not second["rebuilt"] and not second["truncated"]
    assert samples["ep-b#0"]["merged"] is False and samples["ep-b#0"]["env_mask"] == [1, 1]
    for row in samples.values():
        assert len(row["completion_ids"]) == len(row["logprobs"]) == len(row["env_mask"])
        assert row["group_id"] == "1/train/t0" and row["deployment"] == "tiny" and row["round"] == 1
    assert report.sample_counts["merged"] == 2 and report.sample_counts["episodes_split"] == 1

    schema = pq.read_schema(out / "samples.parquet")
    assert str(schema.field("prompt_ids").type) == "list<element: int32>"
    assert str(schema.field("logprobs").type) == "list<element: float>"
    assert str(schema.field("env_mask").type) == "list<element: int8>"
    assert str(schema.field("round").type) == "int32" and str(schema.field("n_turns").type) == "int32"
    stored = json.loads(dstore.fetchall("SELECT report FROM dataset_reports")[0][0])
    assert stored == json.loads((out / "report.json").read_text())

    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(out / "samples.parquet"), split="train")
    assert len(ds) == 3 and ds.features["env_mask"].feature.dtype == "int8"


def _three_and_one(builder):
    """ep-a: three samples (each call rewrites the history); ep-b: one."""
    builder.episode(
        "ep-a",
        sample=0,
        reward=1.0,
        turns=[{"prompt_token_ids": [1, k], "completion_token_ids": [40 + k, 2]} for k in range(3)],
    )
    builder.episode("ep-b", sample=1, reward=0.0, turns=chat_turns([5, 2], [6, 2], env=[90]))


def test_every_episode_weighs_the_same_however_many_samples_it_splits_into(builder, dstore, tmp_path):
    _three_and_one(builder)
    _, samples, _ = _build(dstore, tmp_path)
    by_episode: dict[str, list[float]] = {}
    for row in samples.values():
        by_episode.setdefault(row["episode_id"], []).append(row["weight"])
    assert sorted(len(w) for w in by_episode.values()) == [1, 3]
    assert by_episode["ep-a"] == [pytest.approx(1 / 3)] * 3
    assert {e: sum(w) for e, w in by_episode.items()} == {"ep-a": pytest.approx(1.0), "ep-b": pytest.approx(1.0)}


def test_sample_weighting_weighs_each_sample_one(builder, dstore, tmp_path):
    _three_and_one(builder)
    _, samples, _ = _build(dstore, tmp_path, sample_weight="sample")
    assert len(samples) == 4 and {r["weight"] for r in samples.values()} == {1.0}
    with pytest.raises(LcapError, match="--sample-weight"):
        BuildOptions(sample_weight="token")


def test_merge_requires_exact_token_prefix(builder, dstore, tmp_path):
    # same shape, but the next prompt re-encoded the completion differently: no merge (pitfall 1-2)
    builder.episode(
        "ep-a",
        sample=0,
        reward=1.0,
        turns=[
            {"prompt_token_ids": [1, 2], "completion_token_ids": [40, 41]},
            {"prompt_token_ids": [1, 2, 40, 42, 90], "completion_token_ids": [50]},
        ],
    )
    builder.episode("ep-b", sample=1, reward=0.0, turns=chat_turns([5]))
    _, samples, _ = _build(dstore, tmp_path)
    assert sorted(samples) == ["ep-a#0", "ep-a#1", "ep-b#0"]
    assert not samples["ep-a#1"]["merged"] and samples["ep-a#1"]["prompt_ids"] == [1, 2, 40, 42, 90]


def test_an_episodes_calls_in_two_groups_never_merge_into_one_sample():
    """`lcap export` merges each role's calls as a group of their own: a sub-agent whose prompt holds the whole
    conversation of the role that called it still starts a sample of its own role."""
    ids = pa.list_(pa.int32())
    calls = pa.table(
        {
            "episode_id": ["e", "e"],
            "group_id": ["planner", "solver"],
            "seq": [0, 1],
            "deployment": ["d", "d"],
            "truncated": [False, False],
            "rebuilt": [False, False],
            "prompt_ids": pa.array([[1, 2], [1, 2, 40, 90]], ids),
            "completion_ids": pa.array([[40], [50]], ids),
            "logprobs": pa.array([[-0.5], [-0.5]], pa.list_(pa.float32())),
        }
    )
    samples = merge_turns(calls).to_pylist()
    assert [(s["group_id"], s["prompt_ids"], s["completion_ids"]) for s in samples] == [
        ("planner", [1, 2], [40]),
        ("solver", [1, 2, 40, 90], [50]),
    ]
    one_group = merge_turns(calls.set_column(1, "group_id", pa.array(["g", "g"]))).to_pylist()
    assert [(s["prompt_ids"], s["completion_ids"]) for s in one_group] == [([1, 2], [40, 90, 50])]


def test_advantages_are_group_normalised_with_sample_std(builder, dstore, tmp_path):
    rewards = [0.0, 1.0, 1.0, 0.5]
    _group(builder, "t0", rewards)
    _group(builder, "t1", [0.2, 0.8])
    report, samples, _ = _build(dstore, tmp_path)
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)
    for i, r in enumerate(rewards):
        assert samples[f"t0-{i}#0"]["advantage"] == pytest.approx((r - mean) / (std + 1e-4))
        assert samples[f"t0-{i}#0"]["reward"] == r
    assert samples["t1-0#0"]["advantage"] == pytest.approx(-0.3 / (math.sqrt(0.18) + 1e-4))
    assert report.groups == {"total": 2, "zero_variance": 0, "singleton": 0, "max_size": 4, "trainable": 2}


def test_latest_reward_wins(builder, dstore, tmp_path):
    _group(builder, "t0", [0.0, 1.0])
    builder.reward("t0-0", 2.0)  # a later judge overrides the verifier
    _, samples, _ = _build(dstore, tmp_path)
    assert samples["t0-0#0"]["reward"] == 2.0


def test_cleaning_failed_timeout_unfinished_and_unrewarded_episodes(builder, dstore, tmp_path):
    _group(builder, "t0", [0.0, 1.0])
    builder.episode("bad-failed", task="t0", sample=2, status="failed", reward=1.0, turns=chat_turns([7]))
    builder.episode("bad-timeout", task="t0", sample=3, status="timeout", turns=chat_turns([7]))
    builder.episode("bad-error", task="t0", sample=4, status="error", turns=chat_turns([7]))
    builder.episode("bad-running", task="t0", sample=5, status="running", turns=chat_turns([7]))
    builder.episode("bad-noreward", task="t0", sample=6, turns=chat_turns([7]))
    builder.episode("other-round", task="t0", sample=7, round=2, reward=5.0, turns=chat_turns([7]))
    builder.episode("eval-split", task="t0", sample=7, split="eval", reward=5.0, turns=chat_turns([7]))
    report, samples, _ = _build(dstore, tmp_path)
    assert sorted(samples) == ["t0-0#0", "t0-1#0"]
    e = report.episodes
    assert (e["total"], e["failed"], e["timeout"], e["error"], e["unfinished"], e["no_reward"], e["rewarded"]) == (
        7,
        1,
        1,
        1,
        1,
        1,
        2,
    )
    # the failed episode's reward did not enter the group statistics
    assert samples["t0-1#0"]["advantage"] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4))


def test_cleaning_zero_variance_groups(builder, dstore, tmp_path):
    _group(builder, "t0", [0.0, 1.0])
    _group(builder, "same", [1.0, 1.0, 1.0])
    _group(builder, "alone", [0.3])
    report, samples, _ = _build(dstore, tmp_path)
    assert sorted(samples) == ["t0-0#0", "t0-1#0"]
    assert report.groups["zero_variance"] == 1 and report.groups["singleton"] == 1
    assert report.episodes["zero_variance"] == 4 and report.sample_counts["zero_variance"] == 4
    # the groups line and the lost lines count the same groups (#51 row 7): one of equal rewards, one single
    assert "groups: total 3, zero_variance 1, singleton 1," in "\n".join(report.lines())
    lost = [str(cause) for cause in causes(report)]
    assert any(line.startswith("1 of 3 groups got the same reward") for line in lost), lost
    assert any(line.startswith("1 of 3 groups have a single rewarded episode") for line in lost), lost
    _, kept, _ = _build(dstore, tmp_path, keep_zero_variance=True)
    assert len(kept) == 6 and kept["same-0#0"]["advantage"] == 0.0


def test_cleaning_duplicates(builder, dstore, tmp_path):
    _group(builder, "t0", [0.0, 1.0])
    # the same key (round, split, task, sample) collected twice by two collect runs: the latest wins
    builder.episode("t0-1-again", task="t0", sample=1, reward=0.5, turns=chat_turns([99]))
    # a turn logged twice (same turn_id)
    dstore.execute("INSERT INTO turns SELECT * FROM turns WHERE episode_id = 't0-0'")
    report, samples, _ = _build(dstore, tmp_path)
    assert sorted(samples) == ["t0-0#0", "t0-1-again#0"]
    assert samples["t0-0#0"]["completion_ids"] == [10, 11, 2]  # not doubled
    assert report.episodes["duplicate"] == 1 and report.turns["duplicate"] == 1


def test_cleaning_truncated_drop_mask_and_keep(builder, dstore, tmp_path):
    _group(builder, "t0", [0.0, 1.0])
    turns = chat_turns([30, 31, 2], [40, 41, 42])
    turns[1]["finish_reason"] = "length"
    builder.episode("cut", task="t0", sample=2, reward=1.0, turns=turns)
    report, samples, _ = _build(dstore, tmp_path)
    assert "cut#0" not in samples and report.sample_counts["truncated"] == 1 and report.samples == 2

    report, samples, _ = _build(dstore, tmp_path, truncated="mask")
    cut = samples["cut#0"]
    # merged with the turn before it; the truncated call's tokens are masked, no stop token is added
    assert cut["completion_ids"] == [30, 31, 2, 90, 91, 40, 41, 42]
    assert cut["env_mask"] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert cut["truncated"] is True and report.sample_counts["truncated_masked"] == 1

    report, samples, _ = _build(dstore, tmp_path, truncated="keep")
    kept = samples["cut#0"]
    # trained on as produced: its tokens carry the loss (and its reward), still with no stop token added
    assert kept["completion_ids"] == cut["completion_ids"] and kept["env_mask"] == [1, 1, 1, 0, 0, 1, 1, 1]
    assert report.sample_counts["truncated_kept"] == 1 and report.sample_counts["truncated_masked"] == 0


def test_a_call_after_a_truncated_one_starts_a_new_sample(builder, dstore, tmp_path):
    turns = chat_turns([30, 31], [40, 2])
    turns[0]["finish_reason"] = "length"
    builder.episode("ep", sample=0, reward=1.0, turns=turns)
    builder.episode("ep2", sample=1, reward=0.0, turns=chat_turns([5, 2]))
    _, samples, _ = _build(dstore, tmp_path, truncated="mask")
    assert samples["ep#0"]["env_mask"] == [0, 0] and samples["ep#1"]["completion_ids"] == [40, 2]


def test_cleaning_failed_calls_are_not_trained_on(builder, dstore, tmp_path):
    turns = chat_turns([30, 2], [40, 2])
    turns.insert(
        1,
        {
            "prompt_token_ids": None,
            "completion_token_ids": None,
            "status_code": 500,
            "error": "upstream 500",
            "token_source": None,
        },
    )
    builder.episode("ep", sample=0, reward=1.0, turns=turns)
    builder.episode("ep2", sample=1, reward=0.0, turns=chat_turns([5, 2]))
    builder.episode("ep3", sample=2, reward=0.5, turns=[dict(turns[1])])  # its only call failed
    report, samples, _ = _build(dstore, tmp_path)
    assert samples["ep#0"]["n_turns"] == 2  # the failed call in between does not break the merge
    assert report.turns["failed_calls"] == 2 and report.episodes["no_usable_turns"] == 1
    assert "ep3#0" not in samples


def test_tampered_episodes_keep_reward_zero_or_drop(builder, dstore, tmp_path):
    _group(builder, "t0", [1.0, 1.0])
    builder.episode("cheat", task="t0", sample=2, reward=0.0, turns=chat_turns([66]), flags=["tampered"])
    report, samples, _ = _build(dstore, tmp_path)
    assert samples["cheat#0"]["reward"] == 0.0 and samples["cheat#0"]["advantage"] < 0
    assert report.episodes["tampered"] == 1 and report.sample_counts["tampered"] == 1
    report, samples, _ = _build(dstore, tmp_path, drop_tampered=True, keep_zero_variance=True)
    assert "cheat#0" not in samples


def test_rebuild_turns_without_token_ids(builder, dstore, tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    request = json.dumps({"model": "gpt-4o-mini", "messages": messages})
    dstore.append(
        "deployments",
        [{"name": "tiny", "path": str(tiny_model_dir), "base_model": str(tiny_model_dir), "kind": "base", "round": 0}],
    )
    plain = {
        "prompt_token_ids": None,
        "completion_token_ids": None,
        "completion_logprobs": None,
        "token_source": None,
        "request": request,
        "completion_text": "four",
    }
    builder.episode("ep", sample=0, reward=1.0, turns=[plain])
    builder.episode("ep2", sample=1, reward=0.0, turns=[dict(plain, completion_text="4", finish_reason="length")])
    report, samples, _ = _build(dstore, tmp_path, truncated="mask")
    expected_prompt = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )["input_ids"]
    ep = samples["ep#0"]
    assert ep["rebuilt"] is True and ep["prompt_ids"] == expected_prompt
    assert tok.decode(ep["completion_ids"]) == "four<|im_end|>"  # the template's end of turn, nothing after
    assert ep["logprobs"] == [0.0] * len(ep["completion_ids"])
    assert tok.decode(samples["ep2#0"]["completion_ids"]) == "4"  # truncated: no stop token appended
    assert report.turns["rebuilt_now"] == 2 and report.sample_counts["rebuilt"] == 2
    # cached: a second build re-tokenises nothing
    report, _, _ = _build(dstore, tmp_path)
    assert report.turns["rebuilt_now"] == 0


def test_views_episode_summary_and_samples(builder, dstore):
    builder.episode("ep", sample=0, reward=0.5, turns=chat_turns([30, 2], [40, 2]), flags=["tampered"])
    builder.episode("ep2", sample=1, status="failed", turns=chat_turns([5, 2]))
    row = dstore.fetchall("""SELECT episode_id, task_id, round, split, sample, group_id, status, n_turns,
                                    prompt_tokens, completion_tokens, reward, flags
                             FROM episode_summary ORDER BY episode_id""")
    assert row[0] == ("ep", "t0", 1, "train", 0, "1/train/t0", "ok", 2, 3 + 7, 4, 0.5, ["tampered"])
    assert row[1][6:8] == ("failed", 1) and row[1][10] is None
    (sample,) = dstore.fetchall("SELECT sample_id, n_turns, merged, env_mask FROM samples")
    assert sample == ("ep#0", 2, True, [1, 1, 0, 0, 1, 1])


def test_vectorised_merge_agrees_with_the_samples_view(builder, dstore, tmp_path, monkeypatch):
    """build-dataset merges on Arrow buffers (lcap.dataset.build.merge); the `samples` view states the
    same rule in SQL. Both must give the same samples; small blocks exercise the chunked compare."""
    import random

    from lcap.dataset.build import merge

    monkeypatch.setattr(merge, "_BLOCK", 5)
    rng = random.Random(7)
    for e in range(24):
        prompt, turns = [1, 2, rng.randrange(3, 9)], []
        for _ in range(rng.randrange(1, 5)):
            completion = [rng.randrange(10, 99) for _ in range(rng.randrange(1, 4))]
            turn = {
                "prompt_token_ids": list(prompt),
                "completion_token_ids": completion,
                "completion_logprobs": [-rng.random() for _ in completion],
                "finish_reason": "length" if rng.random() < 0.15 else "stop",
                "deployment": "tiny" if rng.random() < 0.9 else "tiny-r1",
            }
            turns.append(turn)
            roll = rng.random()
            if roll < 0.2:
                prompt = [1, 2, 99]  # history rewritten
            elif roll < 0.3:
                prompt = prompt + completion[:-1] + [5, 6]  # completion re-encoded differently
            else:
                prompt = prompt + completion + [rng.randrange(100, 110) for _ in range(rng.randrange(0, 3))]
        builder.episode(f"ep{e:02d}", task=f"t{e % 4}", sample=e // 4, reward=rng.random(), turns=turns)
    _, built, _ = _build(dstore, tmp_path, keep_zero_variance=True, truncated="mask")
    cols = (
        "sample_id, prompt_ids, completion_ids, logprobs, env_mask, n_turns, merged, truncated, deployment, advantage"
    )
    view = {r[0]: r for r in dstore.fetchall(f"SELECT {cols} FROM samples")}
    assert sorted(view) == sorted(built) and len(view) > 24
    assert sum(r[6] for r in view.values()) > 3 and sum(not r[6] for r in view.values()) > 3
    for sid, (_, prompt, completion, logprobs, env_mask, n_turns, merged, truncated, deployment, adv) in view.items():
        row = built[sid]
        assert (
            row["prompt_ids"],
            row["completion_ids"],
            row["n_turns"],
            row["merged"],
            row["truncated"],
            row["deployment"],
        ) == (prompt, completion, n_turns, merged, truncated, deployment), sid
        assert row["logprobs"] == pytest.approx(logprobs, abs=1e-6) and row["advantage"] == pytest.approx(adv)
        if not truncated:
            assert row["env_mask"] == env_mask


def test_rebuild_anthropic_messages_turn(tiny_model_dir):
    """vLLM returns no ids for /v1/messages: the turn is re-rendered as the equivalent chat."""
    from transformers import AutoTokenizer

    from lcap.dataset.build.rebuild import rebuild_turn

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    request = {
        "model": "claude-x",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Use tools."}],
        "tools": [{"name": "lookup", "description": "Find a fact.", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Capital of France?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "France"}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "Paris"}]}
                ],
            },
        ],
    }
    chat = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Capital of France?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "t1", "name": "lookup", "arguments": {"q": "France"}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Paris"},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "lookup", "description": "Find a fact.", "parameters": {"type": "object"}},
        }
    ]
    prompt, completion = rebuild_turn(tok, "messages", request, "Paris.", None, "end_turn")
    rendered = tok.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    assert prompt == tok(rendered, add_special_tokens=False)["input_ids"]
    assert "Paris" in tok.decode(prompt) and "lookup" in tok.decode(prompt)
    assert tok.decode(completion) == "Paris.<|im_end|>"
    _, cut = rebuild_turn(tok, "messages", request, "Par", None, "max_tokens")
    assert tok.decode(cut) == "Par"  # Anthropic's truncation: no stop token appended
