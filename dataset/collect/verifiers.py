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
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lcap.config import LcapError

VERIFIER_OUTPUT = "verifier.txt"  # in the episode's folder, beside the agent's stdout.txt and stderr.txt


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


@dataclass(frozen=True)
class VerifierContext:
    """What a Python verifier is called with."""

    task: Mapping[str, Any]
    episode_id: str
    workdir: Path
    stdout: str
    exit_code: int | None
    status: str
    transcript: Mapping[str, Any] | None = None  # `lcap rescore`: the episode's transcript
    transcript_file: Path | None = None  # the same as JSON, for a command (LCAP_TRANSCRIPT)

    @property
    def task_id(self) -> str:
        return str(self.task["id"])


class CommandVerifier:
    def __init__(self, argv: Sequence[str], *, timeout: float = 600.0) -> None:
        self.argv = list(argv)
        self.name = shlex.join(self.argv)
        self.timeout = timeout
        self.protected: tuple[str, ...] = ()

    def __call__(self, ctx: VerifierContext) -> Verdict:
        stdout_file = ctx.workdir.parent / "stdout.txt"
        env = dict(os.environ)
        env.update(
            LCAP_TASK=json.dumps(dict(ctx.task), ensure_ascii=False),
            LCAP_EPISODE_ID=ctx.episode_id,
            LCAP_WORKDIR=str(ctx.workdir),
            LCAP_AGENT_STDOUT=str(stdout_file),
            LCAP_AGENT_EXIT_CODE="" if ctx.exit_code is None else str(ctx.exit_code),
        )
        if ctx.transcript_file is not None:
            env["LCAP_TRANSCRIPT"] = str(ctx.transcript_file)
        try:
            proc = subprocess.run(
                self.argv,
                input=ctx.stdout,
                capture_output=True,
                text=True,
                env=env,
                cwd=ctx.workdir,
                timeout=self.timeout,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            raise VerifierError(f"verifier timed out after {self.timeout:.0f}s") from None
        except OSError as exc:
            raise VerifierError(f"cannot run verifier {self.name}: {exc.strerror or exc}") from None
        if proc.returncode != 0:
            said = f"{self.name} exited {proc.returncode}\n--- stderr\n{proc.stderr}--- stdout\n{proc.stdout}"
            raise VerifierError(f"verifier exited {proc.returncode}: {_tail(proc.stderr or proc.stdout)}", said)
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        if not lines:
            raise VerifierError("verifier printed nothing (expected a float or a JSON object with 'reward')")
        try:
            value = json.loads(lines[-1])
        except json.JSONDecodeError:
            raise VerifierError(f"verifier's last line is not a float or JSON: {lines[-1][:200]!r}") from None
        return to_verdict(value)


class PythonVerifier:
    def __init__(self, spec: str, func: Callable[[VerifierContext], Any]) -> None:
        self.name = spec
        self.func = func
        self.protected = tuple(getattr(func, "protected", ()) or ())

    def __call__(self, ctx: VerifierContext) -> Verdict:
        try:
            value = self.func(ctx)
        except Exception as exc:
            said = "".join(traceback.format_exception(exc))
            raise VerifierError(f"{self.name} raised {exc.__class__.__name__}: {exc}", said) from exc
        return to_verdict(value)


Verifier = CommandVerifier | PythonVerifier

_PY_SPEC = re.compile(r"^(?P<target>[\w.]+|\S+\.py):(?P<func>[A-Za-z_]\w*)$")


def load_verifier(spec: str, *, base: Path | None = None) -> Verifier:
    """`module:function`, `file.py:function` or a command line (relative script paths resolved against `base`)."""
    spec = spec.strip()
    if not spec:
        raise LcapError("empty --verifier")
    base = base or Path.cwd()
    match = _PY_SPEC.match(spec)
    if match:
        return PythonVerifier(spec, _import_function(match["target"], match["func"], base))
    return CommandVerifier(resolve_argv(shlex.split(spec), base))


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
    directory must still find agent.py. Nothing else about the arguments changes.
    """
    out = []
    for arg in argv:
        if arg and not arg.startswith("-") and not os.path.isabs(arg) and "{" not in arg and (base / arg).is_file():
            out.append(str((base / arg).resolve()))
        else:
            out.append(arg)
    return out


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


def _tail(text: str, n: int = 300) -> str:
    text = " ".join((text or "").strip().splitlines()[-5:])
    return text[-n:] if text else "(no output)"
