"""The minibugs verifier: `lcap collect --verifier scripts/tasks/minibugs/verify.py:verify`.

It writes the task's pristine test files (the task line's `tests`) over whatever the episode left in its working
directory, runs them in a child Python (isolated: `-I`, the standard library first on its path, then its own copy
of the tests, the workspace last; no bytecode from the workspace; in a PID namespace of its own where bubblewrap is
installed) with a time limit, and rewards the fraction of the task's tests that pass: 1 when all do. Only the
tests the task names count (a test file the agent adds does not), and a skipped test is not a pass. A run that
outlives the limit (`test_timeout` in the task line, else 60 s) or ends without results is a 0 with a reason.
The task's `protected` list has the tamper guard zero an episode that edits a test file before this runs.
"""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TEST_TIMEOUT = 60.0
MAX_FAILURES = 20
MAX_FILE_BYTES = 16 << 20

_FILE_NAME = re.compile(r"^[A-Za-z_]\w*\.py$")

# Runs in the child. The workspace goes last on sys.path, so no file there stands in for a standard module, and the
# verifier's own copy of the tests comes before it, so no package or extension module there named as a test module
# stands in for the tests; files the child writes (its stderr included) are capped in size.
_RUNNER = r"""
import json, resource, sys, unittest
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
tests, work, out, names = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
sys.path += [tests, work]
suite, unloaded = unittest.TestSuite(), []
for name in names:
    try:
        suite.addTests(unittest.defaultTestLoader.loadTestsFromName(name))
    except BaseException as exc:
        unloaded.append({"test": name, "error": f"cannot load: {type(exc).__name__}: {exc}"[:300]})
result = unittest.TestResult()
suite.run(result)
def last_line(text):
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
failures = [{"test": t.id(), "error": last_line(err)} for t, err in result.failures + result.errors]
failures += [{"test": t.id(), "error": "skipped: " + str(why)[:300]} for t, why in result.skipped]
failures += [{"test": t.id(), "error": "unexpected success"} for t in result.unexpectedSuccesses]
with open(out, "w") as f:
    json.dump({"run": result.testsRun, "failures": failures, "unloaded": unloaded}, f)
"""


def verify(ctx):
    tests = dict(ctx.task["tests"])
    expected = int(ctx.task.get("test_count") or 0)
    timeout = float(ctx.task.get("test_timeout") or TEST_TIMEOUT)
    for name, text in tests.items():
        if not _FILE_NAME.match(name):
            raise ValueError(f"test file name {name!r} is not a plain module file name")
        _restore(ctx.workdir / name, text)
    _restore(ctx.workdir / "__pycache__", None)  # no bytecode of the agent's stands in for a restored test
    names = [name[: -len(".py")] for name in sorted(tests)]
    with tempfile.TemporaryDirectory(prefix="minibugs-") as tmp:
        pristine = Path(tmp) / "tests"
        pristine.mkdir()
        for name, text in tests.items():
            (pristine / name).write_text(text)
        out = Path(tmp) / "result.json"
        argv = [*_confined(), sys.executable, "-I", "-B", "-c", _RUNNER, str(MAX_FILE_BYTES)]
        with open(Path(tmp) / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(
                [*argv, str(pristine), str(ctx.workdir), str(out), *names],
                cwd=ctx.workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return 0.0, {"passed": 0, "total": expected, "reason": f"tests timed out after {timeout:g}s"}
            finally:
                _kill_group(proc)  # on a timeout the tests, else anything they left running
        try:
            result = json.loads(out.read_text())
        except (OSError, ValueError):
            return 0.0, {
                "passed": 0,
                "total": expected,
                "reason": f"the test run ended without results (exit {proc.returncode}): {_tail(Path(tmp) / 'stderr.txt')}",
            }
    total = max(expected, int(result["run"]))
    failures = result["failures"]
    passed = max(0, int(result["run"]) - len(failures))
    reward = passed / total if total else 0.0
    return reward, {"passed": passed, "total": total, "failures": (result["unloaded"] + failures)[:MAX_FAILURES]}


def _restore(path: Path, text: str | None) -> None:
    """The pristine file at `path` (or nothing there), whatever the agent put there: a file, a link, a directory."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if text is not None:
        path.write_text(text)


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4096))
        lines = f.read().decode(errors="replace").strip().splitlines()
    return lines[-1][:300] if lines else "(no stderr)"


@functools.cache
def _confined() -> list[str]:
    """Where bubblewrap is installed and may make namespaces, the tests run in a PID namespace of their own that
    ends with them (or when this process kills bwrap): a process they start in another session, out of reach of
    the group kill, ends too. The file system is the same."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return []
    prefix = [bwrap, "--dev-bind", "/", "/", "--unshare-pid", "--die-with-parent", "--"]
    try:
        works = subprocess.run([*prefix, sys.executable, "-I", "-c", ""], capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return []
    return prefix if works.returncode == 0 else []


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
