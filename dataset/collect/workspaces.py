"""Where an episode's workspace comes from, and the task's pristine tests its sandboxed verifier gets.

A task line names its workspace one of two ways: `workspace` (or by its older name `template`), a directory
relative to the tasks file; or `repo` + `commit`, a git repository (a path, relative to the tasks file or absolute,
or a URL git can fetch from here) checked out at that commit. A repository is cloned once into lcap's cache (a
mirror per repository, then a checkout per commit), so the episodes of one repository share one clone, across
collects too. `tests` names the task's pristine test files: a file or directory relative to the tasks file, or
{relative path: text}.

Every path a task names (`workspace`, `template`, `tests` and each file under it, a local `repo`) must resolve,
symlinks and all, inside the tasks file's folder or the `--tasks-root` the user named, and clear of lcap's home:
a tasks file is input, and what it names is copied into the agent's workspace, in a sandbox too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lcap.config import LcapError, lcap_home
from lcap.locks import file_lock

GIT_TIMEOUT = 1800.0  # seconds one git command may take (a large repository's first clone)
CHECKOUT_WAIT = 2 * GIT_TIMEOUT  # for another process's clone and checkout of the same repository


def confined(task: Mapping[str, Any], field: str, path: str | Path, tasks_dir: Path, root: Path | None) -> Path:
    """`path` (the task's `field`, relative to the tasks file's folder `tasks_dir` or absolute) with its symlinks
    resolved; refused in one line unless it is inside `root` (None: `tasks_dir`) and neither in nor above lcap's
    home (its CA key, the proxy's records, the spool's key)."""
    resolved = (tasks_dir / path).resolve()
    top = (root if root is not None else tasks_dir).resolve()
    home = lcap_home().resolve()
    if not resolved.is_relative_to(top):
        raise LcapError(
            f"task {task['id']}: {field} {str(path)!r} is outside {top} (the tasks file's folder; --tasks-root "
            "names another)"
        )
    if resolved.is_relative_to(home) or home.is_relative_to(resolved):
        raise LcapError(f"task {task['id']}: {field} {str(path)!r} reaches lcap's home {home}")
    return resolved


def check_paths(task: Mapping[str, Any], tasks_dir: Path, root: Path | None = None) -> None:
    """Refuse a task whose `workspace`, `template`, `tests` or local `repo` is not `confined` to `root`, before any
    episode runs (each is checked again where it is read)."""
    for key in ("workspace", "template", "tests"):
        if isinstance(task.get(key), str) and task[key]:
            confined(task, key, task[key], tasks_dir, root)
    repo = task.get("repo")
    if isinstance(repo, str) and repo and _local(repo):
        confined(task, "repo", repo.removeprefix("file://"), tasks_dir, root)


def _local(repo: str) -> bool:
    """Whether a task's `repo` names a repository on this machine: a path, or a file:// URL."""
    return repo.startswith("file://") or ("://" not in repo and not repo.startswith("git@"))


def source_dir(task: Mapping[str, Any], tasks_dir: Path, root: Path | None = None) -> Path | None:
    """The directory the task's workspace starts as: its `workspace`/`template` directory or its `repo` checked out
    at `commit` (cached); None if it has neither. Its paths are `confined` to `root`."""
    if task.get("repo"):
        if task.get("workspace") or task.get("template"):
            raise LcapError(f"task {task['id']}: give either workspace or repo + commit, not both")
        if not task.get("commit"):
            raise LcapError(f"task {task['id']}: repo needs a commit")
        return checkout(
            str(task["repo"]),
            str(task["commit"]),
            tasks_dir,
            lambda path: confined(task, "repo", path, tasks_dir, root),
        )
    key = "workspace" if task.get("workspace") else "template"
    template = task.get(key)
    if not template:
        return None
    if not isinstance(template, str):
        raise LcapError(f"task {task['id']}: {key} must be a path (relative to the tasks file)")
    src = confined(task, key, template, tasks_dir, root)
    if not src.is_dir():
        raise LcapError(f"task {task['id']}: {key} {src} is not a directory")
    return src


def checkout(repo: str, commit: str, tasks_dir: Path, check: Callable[[str], Path] | None = None) -> Path:
    """`repo` at `commit`, checked out (with its .git) in lcap's cache: cloned and checked out on first use only.
    Safe to call from several threads and processes at once. `check`: a local repository's path is given to it
    (`confined`) and the path it returns is cloned."""
    local = None
    if _local(repo):
        name = repo.removeprefix("file://")
        local = check(name) if check is not None else (tasks_dir / name).resolve()
    url = str(local) if local is not None and local.exists() else repo
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    cache = lcap_home() / "cache" / "repos"
    mirror = cache / f"{key}.git"
    with file_lock(cache / f"{key}.lock", wait=CHECKOUT_WAIT, doing=f"checking out {repo}"):
        if not mirror.exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))
            _git(["clone", "--quiet", "--mirror", url, str(tmp)], f"cannot clone {repo}")
            tmp.rename(mirror)
        sha = _resolve(mirror, commit)
        if sha is None:
            _git(["-C", str(mirror), "fetch", "--quiet", "origin"], f"cannot fetch {repo}")
            sha = _resolve(mirror, commit)
        if sha is None:
            with contextlib.suppress(LcapError):
                _git(["-C", str(mirror), "fetch", "--quiet", "origin", commit], f"cannot fetch {commit} of {repo}")
            sha = _resolve(mirror, commit)
        if sha is None:
            raise LcapError(f"{repo} has no commit {commit}")
        tree = cache / f"{key}-{sha}"
        if not tree.exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}-{sha[:12]}-", dir=cache))
            try:
                _git(["clone", "--quiet", "--no-checkout", "--no-hardlinks", str(mirror), str(tmp)], "cannot clone")
                _git(["-C", str(tmp), "checkout", "--quiet", "--detach", sha], f"cannot check out {commit}")
                _git(["-C", str(tmp), "remote", "set-url", "origin", url], "cannot set the checkout's origin")
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            tmp.chmod(0o755)
            tmp.rename(tree)
        return tree


def pristine_tests(task: Mapping[str, Any], tasks_dir: Path, root: Path | None = None) -> dict[str, bytes]:
    """The task's `tests` as {path relative to the workspace: bytes}: a file (at its name), a directory (its files
    at their paths in it), or {relative path: text}; empty if the task has none. A path, and each file under a
    directory (a symlink is read where it leads), is `confined` to `root`."""
    tests = task.get("tests")
    if not tests:
        return {}
    if isinstance(tests, Mapping):
        out = {str(k): (v if isinstance(v, str) else str(v)).encode() for k, v in tests.items()}
    elif isinstance(tests, str):
        src = confined(task, "tests", tests, tasks_dir, root)
        if src.is_file():
            out = {src.name: src.read_bytes()}
        elif src.is_dir():
            out = {
                p.relative_to(src).as_posix(): confined(task, "tests", p, tasks_dir, root).read_bytes()
                for p in sorted(src.rglob("*"))
                if p.is_file()
            }
        else:
            raise LcapError(f"task {task['id']}: tests {src} is neither a file nor a directory")
    else:
        raise LcapError(f"task {task['id']}: tests must be a path (relative to the tasks file) or {{path: text}}")
    for rel in out:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise LcapError(f"task {task['id']}: test file {rel!r} is outside the workspace")
    return out


def place_tests(workdir: Path, tests: Mapping[str, bytes]) -> None:
    """Write `tests` over whatever is at their paths in `workdir` (a file, a link, a directory), readable by the
    sandbox's user (the verifier runs as nobody): their modes are set, whatever the user's umask."""
    for rel, data in tests.items():
        target = workdir / rel
        for parent in reversed(target.relative_to(workdir).parents[:-1]):
            folder = workdir / parent
            if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
                folder.unlink()
            if not folder.exists():
                folder.mkdir()
                folder.chmod(0o755)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        target.write_bytes(data)
        target.chmod(0o644)


def _resolve(mirror: Path, rev: str) -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(mirror), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT,
    )
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def _git(args: list[str], what: str) -> None:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, timeout=GIT_TIMEOUT, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LcapError(f"{what}: {exc}") from None
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-2:])
        raise LcapError(f"{what}: git {args[0] if args[0] != '-C' else args[2]} exited {proc.returncode}: {tail}")
