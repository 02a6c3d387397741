"""build-dataset --where: episodes chosen by SQL over `episode_selection`, across rounds, read-only."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures_dataset import chat_turns

from lcap.config import LcapError
from lcap.dataset.build.builder import build_dataset
from lcap.dataset.options import BuildOptions

LCAP = str(Path(sys.executable).parent / "lcap")


def _turns(deployment: str, model: str, *completions: list[int]) -> list[dict]:
    return [dict(t, deployment=deployment, model_served=model) for t in chat_turns(*completions)]


@pytest.fixture
def two_rounds(builder, dstore):
    """Round 1 served by `tiny` (three samples of t0), round 2 by `tiny-r2` (two), an eval episode, and an episode
    of another collect run whose reward a judge gave."""
    for sample, reward in enumerate((1.0, 0.0, 0.5)):
        builder.episode(f"r1-{sample}", round=1, sample=sample, reward=reward, turns=_turns("tiny", "m1", [5, 6], [7]))
    for sample, reward in enumerate((1.0, 0.0)):
        builder.episode(f"r2-{sample}", round=2, sample=sample, reward=reward, turns=_turns("tiny-r2", "m2", [8]))
    builder.episode("ev", round=1, split="eval", reward=1.0, turns=_turns("tiny", "m1", [9]))
    dstore.append(
        "episodes",
        [
            {
                "episode_id": "other-run",
                "status": "ok",
                "labels": json.dumps({"task": "t9", "round": "1", "sample": "0", "collect": "c-42", "team": "x"}),
                "task_id": "t9",
                "round": 1,
                "sample": 0,
                "split": "train",
                "started_at": datetime.now(UTC),
            }
        ],
    )
    builder.reward("other-run", 0.3, source="judge")
    return dstore


def _build(store, tmp_path: Path, where: str | None, round: int | None = None, **options):
    out = tmp_path / f"data-{len(list(tmp_path.iterdir()))}"
    report = build_dataset(
        store, round=round, out=out, options=BuildOptions(where=where, keep_zero_variance=True, **options)
    )
    if not report.samples:  # nothing to train on writes no file (#51 row 5)
        assert not (out / "samples.parquet").exists()
        return report, []
    return report, pq.read_table(out / "samples.parquet").to_pylist()


def test_the_view_documents_each_column(two_rounds):
    rows = two_rounds.fetchall(
        "SELECT episode_id, round, run, split, labels->>'team', model, models, deployment, reward, reward_source, "
        "age > INTERVAL 1 DAY FROM episode_selection ORDER BY episode_id"
    )
    by_id = {r[0]: r[1:] for r in rows}
    assert by_id["r2-0"] == (2, None, "train", None, "m2", ["m2"], "tiny-r2", 1.0, "test", True)
    assert by_id["other-run"] == (1, "c-42", "train", "x", None, [], None, 0.3, "judge", False)


def test_where_spans_rounds_and_keeps_each_samples_behaviour(two_rounds, tmp_path):
    report, samples = _build(two_rounds, tmp_path, "model IN ('m1', 'm2')")
    assert report.round is None and report.title() == "every round (train) where model IN ('m1', 'm2')"
    assert sorted(s["episode_id"] for s in samples) == ["r1-0", "r1-1", "r1-2", "r2-0", "r2-1"]
    for s in samples:  # the behaviour policy of each sample is the deployment that served it, with its logprobs
        assert s["deployment"] == ("tiny" if s["round"] == 1 else "tiny-r2")
        assert [lp for lp, m in zip(s["logprobs"], s["env_mask"]) if m] == [-0.25] * sum(s["env_mask"])
    assert {s["group_id"] for s in samples} == {"1/train/t0", "2/train/t0"}
    assert report.groups["total"] == 2 and report.episodes["total"] == 5

    _, round_two = _build(two_rounds, tmp_path, "model IN ('m1', 'm2')", round=2)
    assert sorted(s["episode_id"] for s in round_two) == ["r2-0", "r2-1"]
    _, by_label = _build(two_rounds, tmp_path, "labels->>'team' = 'x' OR reward_source = 'judge'")
    assert by_label == []  # chosen, but it has no turns


def test_groups_and_advantages_are_the_selections(two_rounds, tmp_path):
    _, samples = _build(two_rounds, tmp_path, "round = 1 AND reward > 0")
    rewards = [1.0, 0.5]
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    got = {s["episode_id"]: s["advantage"] for s in samples}
    assert got == pytest.approx({"r1-0": (1.0 - mean) / (std + 1e-4), "r1-2": (0.5 - mean) / (std + 1e-4)})
    # the whole round's group, built without --where, has three samples and other advantages
    _, whole = _build(two_rounds, tmp_path, None, round=1)
    assert len(whole) == 3 and {s["episode_id"]: s["advantage"] for s in whole}["r1-0"] != pytest.approx(got["r1-0"])


def test_where_reads_its_split_only(two_rounds, tmp_path):
    _, train = _build(two_rounds, tmp_path, "episode_id = 'ev'")
    assert train == []
    _, evals = _build(two_rounds, tmp_path, "episode_id = 'ev'", split="eval")
    assert [s["episode_id"] for s in evals] == ["ev"]


def _cli(db: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LCAP, "build-dataset", "--out", str(out), "--db", str(db), "--keep-zero-variance", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_where_and_its_one_line_errors(two_rounds, tmp_path):
    db = two_rounds.path
    ok = _cli(db, tmp_path / "ok", "--where", "deployment = 'tiny-r2'")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("every round (train) where deployment = 'tiny-r2': 2 samples")
    bad = _cli(db, tmp_path / "bad", "--where", "reward >")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert bad.stderr.startswith("lcap: bad --where: ") and "syntax" in bad.stderr
    nothing = _cli(db, tmp_path / "none", "--where", "reward > 5")
    assert nothing.returncode == 2 and "no train episode matches --where reward > 5" in nothing.stderr
    neither = _cli(db, tmp_path / "neither")
    assert neither.returncode == 2 and neither.stderr.strip() == "lcap: build-dataset needs --round, --where or both"


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("no_such_column = 1", "no_such_column"),
        ("round = 'not a number'", "Conversion Error"),
        ("true); DELETE FROM rewards; SELECT (1", "one SQL condition"),
        # `lcap sql`'s guard: no file system (a plain read-only connection would read the file and go on)
        ("episode_id IN (SELECT content FROM read_text('/etc/hostname'))", "disabled"),
    ],
)
def test_bad_or_harmful_conditions_are_refused(two_rounds, tmp_path, where, said):
    with pytest.raises(LcapError) as refused:
        _build(two_rounds, tmp_path, where)
    message = str(refused.value)
    assert message.startswith("bad --where: ") and "\n" not in message and said in message, message
    assert two_rounds.fetchall("SELECT count(*) FROM rewards") == [(7,)]


def test_an_async_steps_groups_are_rebuilt_whatever_the_step_is_called(builder, dstore, tmp_path, tiny_model_dir):
    """With `groups`, `round` names the async loop's step: the groups' own rounds are re-tokenised."""
    plain = {
        "prompt_token_ids": None,
        "completion_token_ids": None,
        "completion_logprobs": None,
        "token_source": None,
        "request": json.dumps({"messages": [{"role": "user", "content": "2+2?"}]}),
        "completion_text": "4",
    }
    builder.episode("a", round=1, sample=0, reward=1.0, turns=[plain])
    builder.episode("b", round=1, sample=1, reward=0.0, turns=[dict(plain, turn_id="b/0")])
    options = BuildOptions(tokenizer=str(tiny_model_dir))
    report = build_dataset(dstore, round=7, out=tmp_path / "step-7", options=options, groups=["1/train/t0"])
    assert report.turns["rebuilt_now"] == 2 and report.samples == 2


ENDLESS = "(SELECT count(*) FROM range(10000000000000)) > 0"  # runs far past the limit
_SELECT_IN_CHILD = """
import sys
from pathlib import Path
from lcap.dataset.build import select
from lcap.store import Store
select.WHERE_TIMEOUT_S = 1.0
print(select.select_episodes(Store(Path(sys.argv[1])), sys.argv[2]))
"""


def test_a_condition_that_runs_on_is_stopped_at_the_limit(two_rounds):
    child = subprocess.run(
        [sys.executable, "-c", _SELECT_IN_CHILD, str(two_rounds.path), ENDLESS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = "lcap.config.LcapError: bad --where: the condition ran past 1s and was stopped"
    assert child.returncode == 1 and said in child.stderr, child.stderr


def test_an_out_that_is_a_file_is_one_line(two_rounds, tmp_path):
    (tmp_path / "file").write_text("keep\n")
    with pytest.raises(LcapError, match=f"^cannot write {tmp_path / 'file'}: "):
        build_dataset(two_rounds, round=None, out=tmp_path / "file", options=BuildOptions(where="true"))
    assert (tmp_path / "file").read_text() == "keep\n"
