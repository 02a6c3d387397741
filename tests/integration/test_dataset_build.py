"""build-dataset on real DuckDB stores: merge and env masks, advantages, each cleaning rule, views."""

from __future__ import annotations

from fixtures_dataset import chat_turns


def test_reward_command(builder, dstore, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    lcap = Path(sys.executable).parent / "lcap"
    builder.episode("ep", reward=None, turns=chat_turns([5]))
    ok = subprocess.run(
        [str(lcap), "reward", "ep", "0.7", "--details", '{"judge": "human"}', "--db", str(dstore.path)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([str(lcap), "reward", "nope", "1", "--db", str(dstore.path)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == f"lcap: no episode 'nope' in {dstore.path}"
    assert dstore.fetchall("SELECT reward, details->>'judge', source FROM latest_rewards") == [(0.7, "human", "cli")]
    built = subprocess.run(
        [
            str(lcap),
            "build-dataset",
            "--round",
            "1",
            "--out",
            str(tmp_path / "data"),
            "--keep-zero-variance",
            "--truncated",
            "mask",
            "--db",
            str(dstore.path),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    assert built.stdout.startswith(f"round 1 (train): 1 samples -> {tmp_path / 'data'}")
    assert "groups: total 1, zero_variance 0, singleton 1" in built.stdout  # a single episode: singleton only
    bad = subprocess.run(
        [
            str(lcap),
            "build-dataset",
            "--round",
            "1",
            "--out",
            str(tmp_path / "d2"),
            "--truncated",
            "cut",
            "--db",
            str(dstore.path),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.strip() == "lcap: --truncated must be drop, mask or keep, not 'cut'"
