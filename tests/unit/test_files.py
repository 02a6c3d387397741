"""Files written whole or not at all (lcap.files): every atomic write in lcap goes through it
(tests/unit/test_house_rules.py)."""

from __future__ import annotations

import stat

import pytest

from lcap.files import atomic_write, replacing


def test_a_write_replaces_the_file_whole_with_its_mode_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "record.json"
    target.write_text("old")
    atomic_write(target, '{"new": 1}', mode=0o600)
    assert target.read_text() == '{"new": 1}' and stat.S_IMODE(target.stat().st_mode) == 0o600
    atomic_write(target, b"\x00bytes")
    assert target.read_bytes() == b"\x00bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path):
    target = tmp_path / "samples.parquet"
    target.write_text("whole")
    with pytest.raises(RuntimeError), replacing(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the writer failed")
    assert target.read_text() == "whole"
    assert [p.name for p in tmp_path.iterdir()] == ["samples.parquet"]


def test_the_new_file_is_made_for_the_write_never_found(tmp_path, monkeypatch):
    """A link planted at the name a write would use is never written through: the write takes another name."""
    target = tmp_path / "out.jsonl"
    outside = tmp_path / "outside"
    (tmp_path / ".out.jsonl.a.tmp").symlink_to(outside)
    names = iter(["a", "b"])
    monkeypatch.setattr("lcap.files.secrets.token_hex", lambda _n: next(names))
    atomic_write(target, "mine")
    assert target.read_text() == "mine" and not outside.exists()
    assert (tmp_path / ".out.jsonl.a.tmp").is_symlink()
