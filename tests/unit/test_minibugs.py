"""The minibugs task set's generator (scripts/tasks/minibugs/make.py): the same seed gives the same bytes, and every
task it makes holds a correct module's mutant that fails at least one of its tests while the original passes them
all, checked here again over the whole set, in this process."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

MINIBUGS = Path(__file__).resolve().parents[2] / "scripts" / "tasks" / "minibugs"


def _load_make():
    spec = importlib.util.spec_from_file_location("minibugs_make", MINIBUGS / "make.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


make = _load_make()


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def seed0(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seed0")
    make.make(0, out)
    return out


def test_the_same_seed_gives_the_same_bytes(seed0, tmp_path):
    make.make(0, tmp_path / "again")
    assert _files(tmp_path / "again") == _files(seed0)
    make.make(1, tmp_path / "other")
    other = _files(tmp_path / "other")
    assert other.keys() != _files(seed0).keys() or other != _files(seed0)
    with pytest.raises(SystemExit, match="not empty"):
        make.make(0, seed0)


def test_every_task_is_one_bug_that_a_test_sees(seed0):
    train, heldout = _lines(seed0 / "train.jsonl"), _lines(seed0 / "heldout.jsonl")
    fixes = {f["id"]: f for f in _lines(seed0 / "fixes.jsonl")}
    tasks = train + heldout
    assert len(tasks) >= 40 and len(heldout) >= 8 and sorted(fixes) == sorted(t["id"] for t in tasks)
    assert {t["split"] for t in train} == {"train"} and {t["split"] for t in heldout} == {"heldout"}
    functions = {split: {t["module"] for t in rows} for split, rows in (("train", train), ("heldout", heldout))}
    assert not functions["train"] & functions["heldout"]  # held-out bugs sit in functions training never sees

    kinds = set()
    for task in tasks:
        fix = fixes[task["id"]]
        module, (tests_file, tests_text) = task["module"], *task["tests"].items()
        workspace = seed0 / task["workspace"]
        assert sorted(p.name for p in workspace.iterdir()) == sorted([module, tests_file])
        assert (workspace / tests_file).read_text() == tests_text and task["protected"] == [tests_file]
        mutant = (workspace / module).read_text()
        assert mutant != fix["original"] and fix["original"] not in json.dumps(task)  # the fix is not given away
        assert module in task["prompt"] and tests_file in task["prompt"]

        name = module.removesuffix(".py")
        original = make.run_tests(name, fix["original"], f"test_{name}", tests_text)
        assert original.failed == [] and original.total == task["test_count"] and not original.hung
        broken = make.run_tests(name, mutant, f"test_{name}", tests_text)
        assert broken.failed == fix["failing"] and len(broken.failed) >= 1 and not (broken.hung or broken.broken)
        kinds.add(fix["mutation"]["kind"])
    assert len(kinds) >= 4


def test_corpus_modules_shadow_no_standard_module():
    names = {p.stem.removeprefix("test_") for p in (MINIBUGS / "corpus").glob("*.py")}
    assert len(names) >= 25 and not names & sys.stdlib_module_names


def test_a_mutant_that_hangs_or_does_not_compile_is_told_apart():
    tests = "import unittest\nfrom spin import f\nclass T(unittest.TestCase):\n    def test_f(self):\n        f()\n"
    hung = make.run_tests("spin", "def f():\n    while True:\n        pass\n", "test_spin", tests)
    assert hung.hung and hung.failed == ["test_spin.T.test_f"]
    assert make.run_tests("spin", "def f(:\n", "test_spin", tests).broken
    assert make.run_tests("spin", "def f():\n    return 1\n", "test_spin", tests) == make.Outcome(1, [])


def test_mutations_cover_the_documented_kinds():
    text = (
        "def f(xs, n):\n    if n < 0:\n        return []\n    ok = True and n > 2\n    n += 1\n    return xs[: n - 1]\n"
    )
    found = {(m.kind, m.new) for m in make.mutations(text)}
    assert {
        ("wrong_comparison", "<="),
        ("dropped_branch", ""),
        ("wrong_constant", "False"),
        ("swapped_boolean", "or"),
        ("swapped_operator", "-="),
        ("swapped_operator", "+"),
        ("off_by_one", "2"),
    } <= found
    dropped = next(m for m in make.mutations(text) if m.kind == "dropped_branch")
    assert dropped.apply(text).splitlines()[1] == "    ok = True and n > 2"
