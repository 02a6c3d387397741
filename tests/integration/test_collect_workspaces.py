"""dataset/collect/workspaces.py: a task's workspace source (directory, or repo + commit from lcap's cache) and its
pristine tests, with a real git repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lcap.config import LcapError
from lcap.dataset.collect.workspaces import check_paths, place_tests, pristine_tests, source_dir

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="no git")


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def test_repo_commits_come_from_one_mirror_and_a_later_commit_is_fetched(tmp_path, monkeypatch):
    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("one")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    first = _git(repo, "rev-parse", "HEAD").strip()
    tree = source_dir({"id": "t", "repo": "repo", "commit": first}, tmp_path)
    assert tree is not None and (tree / "a.txt").read_text() == "one"
    assert source_dir({"id": "t", "repo": str(repo), "commit": first}, tmp_path) == tree  # the same cached checkout
    (repo / "a.txt").write_text("two")
    _git(repo, "commit", "-q", "-am", "two")
    second = _git(repo, "rev-parse", "HEAD").strip()
    later = source_dir({"id": "t", "repo": "repo", "commit": second}, tmp_path)  # not in the mirror yet: fetched
    assert later is not None and (later / "a.txt").read_text() == "two"
    assert _git(later, "rev-parse", "HEAD").strip() == second
    assert len(list((tmp_path / "home" / "cache" / "repos").glob("*.git"))) == 1
    with pytest.raises(LcapError, match="has no commit"):
        source_dir({"id": "t", "repo": "repo", "commit": "0" * 40}, tmp_path)


def test_a_task_names_one_workspace_source(tmp_path):
    (tmp_path / "ws").mkdir()
    assert source_dir({"id": "t", "workspace": "ws"}, tmp_path) == tmp_path / "ws"
    assert source_dir({"id": "t"}, tmp_path) is None
    with pytest.raises(LcapError, match="either workspace or repo"):
        source_dir({"id": "t", "workspace": "ws", "repo": "r", "commit": "c"}, tmp_path)
    with pytest.raises(LcapError, match="repo needs a commit"):
        source_dir({"id": "t", "repo": "r"}, tmp_path)


def test_pristine_tests_from_a_file_a_directory_or_text_replace_whatever_is_there(tmp_path):
    (tmp_path / "t" / "sub").mkdir(parents=True)
    (tmp_path / "t" / "test_a.py").write_text("a")
    (tmp_path / "t" / "sub" / "test_b.py").write_text("b")
    assert pristine_tests({"id": "x", "tests": "t/test_a.py"}, tmp_path) == {"test_a.py": b"a"}
    assert pristine_tests({"id": "x", "tests": "t"}, tmp_path) == {"sub/test_b.py": b"b", "test_a.py": b"a"}
    assert pristine_tests({"id": "x", "tests": {"test_c.py": "c"}}, tmp_path) == {"test_c.py": b"c"}
    with pytest.raises(LcapError, match="outside the workspace"):
        pristine_tests({"id": "x", "tests": {"../escape.py": "c"}}, tmp_path)
    work = tmp_path / "work"
    (work / "test_a.py").mkdir(parents=True)  # the agent made a directory where a test file goes
    (work / "sub").symlink_to("/etc")  # and a link where a test folder goes
    place_tests(work, pristine_tests({"id": "x", "tests": "t"}, tmp_path))
    assert (work / "test_a.py").read_text() == "a"
    assert not (work / "sub").is_symlink() and (work / "sub" / "test_b.py").read_text() == "b"


def test_every_path_a_task_names_stays_in_the_tasks_folder_or_the_named_root(tmp_path, monkeypatch):
    """A hostile tasks file's workspace `../x`, an absolute path, a symlinked folder, lcap's home, a tests folder
    with a link to a secret, a repo outside (by path or file:// URL): each refused in one line naming the field,
    symlinks resolved first (issue 48 row 3: lcap's CA key was copied into the sandbox). `root` (--tasks-root)
    admits a folder above the tasks file's."""
    home = tmp_path / "project" / "tasks" / "home"  # lcap's home inside the tasks folder: still refused
    monkeypatch.setenv("LCAP_HOME", str(home))
    (home / "ca").mkdir(parents=True)
    (home / "ca" / "key.pem").write_text("secret")
    tasks = tmp_path / "project" / "tasks"
    outside = tmp_path / "project" / "shared"
    (outside / "ws").mkdir(parents=True)
    (tasks / "ws").mkdir()
    (tasks / "linked").symlink_to(outside / "ws")
    (tasks / "t").mkdir()
    (tasks / "t" / "test_a.py").write_text("a")
    (tasks / "t" / "leak.py").symlink_to(home / "ca" / "key.pem")
    repo = outside / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    cases = [
        ({"workspace": "../shared/ws"}, "workspace '../shared/ws' is outside"),
        ({"workspace": str(outside / "ws")}, "is outside"),
        ({"template": "linked"}, "template 'linked' is outside"),
        ({"workspace": "home"}, "workspace 'home' reaches lcap's home"),
        ({"workspace": "."}, "workspace '.' reaches lcap's home"),
        ({"tests": "home/ca/key.pem"}, "tests 'home/ca/key.pem' reaches lcap's home"),
        ({"tests": "t"}, "leak.py' reaches lcap's home"),
        ({"repo": "../shared/repo", "commit": "HEAD"}, "repo '../shared/repo' is outside"),
        ({"repo": f"file://{repo}", "commit": "HEAD"}, "is outside"),
    ]
    for fields, refusal in cases:
        task = {"id": "x", **fields}
        with pytest.raises(LcapError, match=f"^task x: .*{refusal}") as caught:
            source_dir(task, tasks)
            pristine_tests(task, tasks)
        assert "\n" not in str(caught.value)
        if fields != {"tests": "t"}:  # a file under a tests folder is checked where it is read
            with pytest.raises(LcapError, match=refusal):
                check_paths(task, tasks)
    assert source_dir({"id": "x", "workspace": "ws"}, tasks) == tasks / "ws"
    assert source_dir({"id": "x", "workspace": "../shared/ws"}, tasks, root=tmp_path / "project") == outside / "ws"
    assert source_dir({"id": "x", "template": "linked"}, tasks, root=tmp_path / "project") == outside / "ws"
    with pytest.raises(LcapError, match="reaches lcap's home"):
        check_paths({"id": "x", "workspace": "tasks"}, tasks.parent, root=tmp_path)


def test_lcap_collect_refuses_a_task_path_outside_the_tasks_folder_in_one_line(tmp_path):
    """`lcap collect` stops before any episode: exit 2, one line naming the task and the field."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "tasks").mkdir()
    tasks = tmp_path / "tasks" / "tasks.jsonl"
    tasks.write_text('{"id": "t1", "workspace": "../secret"}\n')
    env = {**os.environ, "LCAP_HOME": str(tmp_path / "home"), "LCAP_DB": str(tmp_path / "lcap.duckdb")}
    lcap = str(Path(sys.executable).parent / "lcap")
    args = [lcap, "collect", "--tasks", str(tasks), "--upstream", "none", "-g", "1", "--", "true"]
    proc = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"lcap: task t1: workspace '../secret' is outside {tmp_path / 'tasks'} (the tasks file's folder; "
        "--tasks-root names another)"
    ]
    assert not (tmp_path / "lcap-runs").exists()
    ok = subprocess.run(
        [*args[:-2], "--tasks-root", str(tmp_path), "--", "true"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
