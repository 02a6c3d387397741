"""Verifiers: what turns a finished episode into a reward, run outside the agent.

A verifier is either a command or a Python callable:

* command (`--verifier "python verify.py"`): runs in the episode's working directory with the
  task as JSON in `LCAP_TASK`, the episode id in `LCAP_EPISODE_ID`, the working directory in
  `LCAP_WORKDIR`, the agent's exit code in `LCAP_AGENT_EXIT_CODE` and its stdout both on stdin
  and in the file named by `LCAP_AGENT_STDOUT`. It prints a float, or a JSON object with
  `reward` and any details, as its last line. A non-zero exit is a verifier error. Under `lcap rescore` it
  also gets the episode's transcript (`lcap.dataset.build.export.transcripts`) as JSON in the file named by
  `LCAP_TRANSCRIPT`, and runs in the episode's kept workspace, else in an empty folder.
* `module:function` or `path/to/file.py:function`: called with a `VerifierContext`; returns a
  float, a `(reward, details)` pair, a dict with `reward`, or a `Verdict`. A function may declare
  the files it protects from the agent with a `protected` attribute (globs in the workdir).

Either way an exception is an error on that episode, never on the collect run.

With `--sandbox` either kind runs in a sandbox of its own (`Sandbox.verifier`, passed as `box`): a command as it
is, a Python function in a child Python (`python -m lcap.dataset.collect.verifiers`) that gets the context as
JSON on stdin and answers the verdict as JSON; what the verifier printed goes to the verdict's details.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lcap.config import LcapError
from lcap.dataset.judge.prompt import is_judge

if TYPE_CHECKING:
    from lcap.capture import EpisodeSandbox

VERIFIER_OUTPUT = "verifier.txt"  # in the episode's folder, beside the agent's stdout.txt and stderr.txt
DEFAULT_TIMEOUT = 600.0
OUTPUT_DETAIL = 4000  # characters of a sandboxed verifier's output kept in the reward's details (all: verifier.txt)
REAPER = Path(__file__).with_name("reaper.py")  # a verifier outside a sandbox runs under it (run_process)
REAPER_GRACE_S = 5.0  # seconds the reaper has to end what a timed-out verifier left


class VerifierError(Exception):
    """The verifier crashed, timed out or printed no reward; `output`: all it said (its stderr and stdout, or the
    Python verifier's traceback), which collect keeps in the episode's verifier.txt."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class Verdict:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)
    output: str = ""  # all a sandboxed verifier printed (its end is in the details too)


@dataclass(frozen=True)
class VerifierContext:
    """What a Python verifier is called with."""

    task: Mapping[str, Any]
    episode_id: str
    workdir: Path
    stdout: str
    exit_code: int | None
    status: str
    sample: int = 0  # the episode's place in its task's group (0 .. group_size-1), as its `sample` label
    transcript: Mapping[str, Any] | None = None  # `lcap rescore`: the episode's transcript
    transcript_file: Path | None = None  # the same as JSON, for a command (LCAP_TRANSCRIPT)

    @property
    def task_id(self) -> str:
        return str(self.task["id"])

    def to_json(self) -> dict[str, Any]:
        """The context as JSON, for a verifier called in a child Python (`from_json`)."""
        return {
            f.name: str(v) if isinstance(v, Path) else dict(v) if isinstance(v, Mapping) else v
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VerifierContext:
        paths = {"workdir", "transcript_file"}
        values: dict[str, Any] = {k: Path(v) if k in paths and v is not None else v for k, v in data.items()}
        return cls(**values)


class CommandVerifier:
    def __init__(self, argv: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.argv = list(argv)
        self.name = shlex.join(self.argv)
        self.timeout = timeout
        self.protected: tuple[str, ...] = ()

    def __call__(self, ctx: VerifierContext, box: EpisodeSandbox | None = None) -> Verdict:
        stdout_file = ctx.workdir.parent / "stdout.txt"
        env = dict(os.environ)
        env.update(
            LCAP_TASK=json.dumps(dict(ctx.task), ensure_ascii=False),
            LCAP_EPISODE_ID=ctx.episode_id,
            LCAP_SAMPLE=str(ctx.sample),
            LCAP_WORKDIR=str(ctx.workdir),
            LCAP_AGENT_STDOUT=str(stdout_file),
            LCAP_AGENT_EXIT_CODE="" if ctx.exit_code is None else str(ctx.exit_code),
        )
        if ctx.transcript_file is not None:
            env["LCAP_TRANSCRIPT"] = str(ctx.transcript_file)
        code, out, err = run_process(self.argv, env, ctx.workdir, ctx.stdout, self.timeout, box, self.name)
        said = f"{self.name} exited {code}\n--- stderr\n{err}--- stdout\n{out}"
        if code != 0:
            raise VerifierError(f"verifier exited {code}: {tail(err or out)}", said)
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        if not lines:
            raise VerifierError("verifier printed nothing (expected a float or a JSON object with 'reward')", said)
        try:
            value = json.loads(lines[-1])
        except json.JSONDecodeError:
            raise VerifierError(f"verifier's last line is not a float or JSON: {lines[-1][:200]!r}", said) from None
        return with_output(to_verdict(value), said) if box is not None else to_verdict(value)


class PythonVerifier:
    def __init__(
        self, spec: str, func: Callable[[VerifierContext], Any], *, source: tuple[str, str, Path] | None = None
    ) -> None:
        """`source`: (module or file, function, base folder) to load it again in a sandboxed child Python."""
        self.name = spec
        self.func = func
        self.protected = tuple(getattr(func, "protected", ()) or ())
        self.source = source
        self.timeout = DEFAULT_TIMEOUT

    def __call__(self, ctx: VerifierContext, box: EpisodeSandbox | None = None) -> Verdict:
        if box is not None:
            return self._in(box, ctx)
        try:
            value = self.func(ctx)
        except Exception as exc:
            said = "".join(traceback.format_exception(exc))
            raise VerifierError(f"{self.name} raised {exc.__class__.__name__}: {exc}", said) from exc
        return to_verdict(value)

    def _in(self, box: EpisodeSandbox, ctx: VerifierContext) -> Verdict:
        """Call the function in a child Python in `box`."""
        if self.source is None:
            raise VerifierError(f"{self.name} cannot be loaded again in a sandbox")
        target, func, base = self.source
        request = {"target": target, "func": func, "base": str(base), "context": ctx.to_json()}
        argv = [sys.executable, "-I", "-m", __name__]
        stdin = json.dumps(request, ensure_ascii=False, default=str)
        code, out, err = run_process(argv, dict(os.environ), ctx.workdir, stdin, self.timeout, box, self.name)
        said = f"{self.name} in a sandbox, exited {code}\n--- output\n{err}"
        try:
            answer = json.loads(out.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            raise VerifierError(f"{self.name} ended without a verdict (exit {code}): {tail(err)}", said) from None
        if "error" in answer:
            raise VerifierError(str(answer["error"]), said)
        return with_output(to_verdict((answer["reward"], answer["details"])), said)


Verifier = CommandVerifier | PythonVerifier


def verifier_files(judge: Verifier) -> list[Path]:
    """What a verifier loads from the host besides its command's files, for its sandbox to show: a Python one's
    file's folder (its siblings may be imported), or for a module the folder it is imported from."""
    if isinstance(judge, PythonVerifier) and judge.source is not None:
        target, _, base = judge.source
        return [Path(target).parent if target.endswith(".py") else Path(base)]
    return []


_PY_SPEC = re.compile(r"^(?P<target>[\w.]+|\S+\.py):(?P<func>[A-Za-z_]\w*)$")


def load_verifier(spec: str, *, base: Path | None = None) -> Verifier:
    """`module:function`, `file.py:function` or a command line (relative script paths resolved against `base`)."""
    spec = spec.strip()
    if not spec:
        raise LcapError("empty --verifier")
    if is_judge(spec):  # a judge scores stored episodes, in groups: lcap.dataset.judge.run, not per episode
        raise LcapError("judge:RUBRIC.md is not a per-episode verifier: collect, loop and rescore run it")
    base = base or Path.cwd()
    match = _PY_SPEC.match(spec)
    if match:
        target = str((base / match["target"]).resolve()) if match["target"].endswith(".py") else match["target"]
        func = _import_function(match["target"], match["func"], base)
        return PythonVerifier(spec, func, source=(target, match["func"], base))
    return CommandVerifier(resolve_argv(shlex.split(spec), base))


def run_process(
    argv: Sequence[str],
    env: dict[str, str],
    cwd: Path,
    stdin: str,
    timeout: float,
    box: EpisodeSandbox | None,
    name: str,
) -> tuple[int, str, str]:
    """Run a verifier's process (in `box`, a fresh sandbox, when given) to its end: (exit code, stdout, stderr).
    It leads a process group of its own, killed when it ends or outlives `timeout`; outside a sandbox (whose PID
    namespace ends with it) it runs under `reaper.py`, which also ends what left the group (`setsid`)."""
    pass_fds: tuple[int, ...] = ()
    on_start: Callable[[subprocess.Popen], None] | None = None
    if box is not None:
        child, env = box.child(argv, env, 0)
        argv, pass_fds, on_start, cwd = child.argv, child.pass_fds, child.on_start, box.workdir
    else:
        argv = [sys.executable, "-I", str(REAPER), *argv]
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            cwd=cwd,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    except OSError as exc:
        raise VerifierError(f"cannot run verifier {name}: {exc.strerror or exc}") from None
    try:
        if on_start is not None:
            on_start(proc)
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise VerifierError(f"verifier timed out after {timeout:.0f}s") from None
    except BaseException:
        _kill(proc)
        raise
    _kill(proc)
    return proc.returncode, out, err


def _kill(proc: subprocess.Popen) -> None:
    """End the verifier: its reaper first (SIGTERM: it kills what left the group), then the whole group."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(REAPER_GRACE_S)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
        proc.communicate(timeout=5)


def with_output(verdict: Verdict, said: str) -> Verdict:
    """A sandboxed verifier's verdict, with the end of what it printed in its details (`verifier_output`)."""
    return Verdict(verdict.reward, {**verdict.details, "verifier_output": said[-OUTPUT_DETAIL:]}, said)


def _import_function(target: str, func: str, base: Path) -> Callable:
    if target.endswith(".py"):
        path = (base / target).resolve()
        if not path.is_file():
            raise LcapError(f"verifier file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"lcap_verifier_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise LcapError(f"cannot load verifier {path}: not a Python module")
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise LcapError(f"cannot load verifier {path}: {exc.__class__.__name__}: {exc}") from None
    else:
        if str(base) not in sys.path:
            sys.path.insert(0, str(base))
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise LcapError(f"cannot import verifier module {target!r}: {exc}") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise LcapError(f"verifier {target}:{func} is not a function")
    return fn


def to_verdict(value: Any) -> Verdict:
    """Normalise what a verifier returned; anything without a finite reward is a verifier error."""
    details: dict[str, Any] = {}
    if isinstance(value, Verdict):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        value, details = value[0], dict(value[1] or {})
    elif isinstance(value, Mapping):
        if "reward" not in value:
            raise VerifierError(f"verifier returned an object without 'reward': {json.dumps(value)[:200]}")
        details = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise VerifierError(f"verifier returned {value!r}, not a number") from None
    if not math.isfinite(reward):
        raise VerifierError(f"verifier returned a non-finite reward {reward}")
    return Verdict(reward, details)


def resolve_argv(argv: Sequence[str], base: Path) -> list[str]:
    """Make arguments that name an existing file relative to `base` absolute.

    Episodes run in their own working directory, so `python agent.py` typed in the project
    directory must still find agent.py. Nothing else about the arguments changes: a symbolic link
    stays one (a venv's `.venv/bin/python` links to the Python it was made from, which run by its
    own path would not see the venv's packages).
    """
    return [
        str(base / arg)
        if arg and not arg.startswith("-") and not os.path.isabs(arg) and "{" not in arg and (base / arg).is_file()
        else arg
        for arg in argv
    ]


# --- tamper guard ---------------------------------------------------------------------------


def hash_protected(workdir: Path, globs: Iterable[str]) -> dict[str, str]:
    """sha256 of every file matching `globs` under `workdir` (a matched directory: every file in it)."""
    digests: dict[str, str] = {}
    for pattern in globs:
        for match in sorted(workdir.glob(pattern)):
            paths = [match] if match.is_symlink() or not match.is_dir() else sorted(match.rglob("*"))
            for path in paths:
                rel = path.relative_to(workdir).as_posix()
                if path.is_symlink():
                    digests[rel] = "symlink:" + os.readlink(path)
                elif path.is_file():
                    digests[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def tampered_files(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """Protected files changed, deleted or added during the episode."""
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


def tail(text: str, lines: int = 5, empty: str = "(no output)", n: int = 300) -> str:
    """The end of what a process said, on one line: its last `lines` lines, at most `n` characters."""
    text = " ".join((text or "").strip().splitlines()[-lines:])
    return text[-n:] if text else empty


def _child_main() -> None:
    """A sandboxed Python verifier's child: the request on stdin, the verdict (or the error) as JSON on stdout;
    whatever the function prints goes to stderr."""
    request = json.loads(sys.stdin.read())
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        func = _import_function(request["target"], request["func"], Path(request["base"]))
        ctx = VerifierContext.from_json(request["context"])
        verdict = to_verdict(func(ctx))
        answer: dict[str, Any] = {"reward": verdict.reward, "details": verdict.details}
    except Exception as exc:
        traceback.print_exc()
        answer = {"error": f"{request['target']}:{request['func']} raised {exc.__class__.__name__}: {exc}"}
    with os.fdopen(answer_fd, "w") as out:
        out.write(json.dumps(answer, default=str) + "\n")


if __name__ == "__main__":
    _child_main()
