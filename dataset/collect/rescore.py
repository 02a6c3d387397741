"""`lcap rescore`: a verifier run again over stored episodes, its verdicts stored as rewards of a source of their own.

The episodes are a `--where` selection (`lcap.dataset.build.select`, build-dataset's guard). Each is scored by
collect's verifier protocol (`verifiers.py`) with its transcript (`lcap.dataset.build.export.transcripts`, as JSON
in `LCAP_TRANSCRIPT` or `ctx.transcript`) and the agent's stdout when collect kept it, in the episode's workspace
when collect's workdir is still on disk, else in an empty folder of its own. `--concurrency` verifiers run at once,
each bounded by `--timeout`. Every reward carries an idempotency key per (source, episode): a rerun skips the
episodes the source scored, and a verdict written twice (a crash between a verifier and the write) is stored once.
A failing verifier is an episode flag `rescore_error` (its source, the error, the end of what it said); an episode
collect's tamper guard flagged gets reward 0 from the guard, unscored, as collect gives it.

A verifier runs sandboxed where `--sandbox` is given, and for an episode collected with `--sandbox` (its label
`sandbox`) whether or not it is: its workspace is an agent's work, and what verified it sandboxed once is never
run on the host over it. The sandbox is collect's verifier sandbox, by the same function
(`episode.verify_in_sandbox`): no network, the host's nobody, of the host only the system folders, the verifier's
files, the episode's stdout and transcript, over a copy of its kept workspace (else an empty one) with the task's
pristine tests put over it; lcap's home, the store, the collect's run folders and the other episodes' files
hidden. Outside a sandbox a command verifier runs under collect's reaper (`verifiers.run_process`): everything it
started ends at its timeout.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lcap.capture import Sandbox, missing, sandbox_limits
from lcap.config import LcapError
from lcap.dataset.build.export import transcripts
from lcap.dataset.build.select import select_episodes
from lcap.dataset.collect.episode import verify_in_sandbox
from lcap.dataset.collect.episodes import load_tasks
from lcap.dataset.collect.verifiers import Verdict, Verifier, VerifierContext, VerifierError, load_verifier
from lcap.dataset.collect.workspaces import pristine_tests
from lcap.dataset.judge.prompt import is_judge
from lcap.dataset.judge.run import JudgeResult, judge_episodes
from lcap.dataset.options import RescoreOptions
from lcap.progress import Reporter
from lcap.store import Store, now

FLAG = "rescore_error"
WRITE_EVERY = 64  # verdicts per write of the store
WRITE_AFTER_S = 2.0  # a verdict waits at most this long for its write
LOAD_CHUNK = 64  # episodes whose transcripts one read of the store loads
OUTPUT_KEPT = 4000  # characters of a failing verifier's output kept in its flag

_EPISODES = """
SELECT s.episode_id, s.task_id, s.status, s.exit_code, s.flags, e.cwd, e.labels->>'collect' AS collect,
       e.labels->>'sandbox' = 'true' AS sandboxed
FROM episode_summary s JOIN episodes e USING (episode_id)
WHERE s.episode_id IN (SELECT unnest(?::VARCHAR[]))
"""
# The episodes collected with --sandbox among some, and the run folders their workspaces sit in (hidden from every
# sandboxed verifier: the other episodes' workspaces and outputs).
_SANDBOXED = """
SELECT count(*) FILTER (WHERE labels->>'sandbox' = 'true'),
       list(DISTINCT cwd) FILTER (WHERE labels->>'collect' IS NOT NULL AND cwd IS NOT NULL)
FROM episodes WHERE episode_id IN (SELECT unnest(?::VARCHAR[]))
"""

_STORE_VERDICTS = """
INSERT INTO rewards (episode_id, value, details, source, created_at, key)
SELECT b.* FROM (
    SELECT unnest($episodes::VARCHAR[]), unnest($values::DOUBLE[]), unnest($details::VARCHAR[])::JSON, $source,
           $at::TIMESTAMPTZ, unnest($keys::VARCHAR[])) b(episode_id, value, details, source, created_at, key)
WHERE NOT EXISTS (SELECT 1 FROM rewards r WHERE r.key = b.key)
"""


def reward_key(source: str, episode_id: str) -> str:
    """The idempotency key of `source`'s reward of an episode."""
    return "rescore:" + hashlib.sha256(f"{source}\0{episode_id}".encode()).hexdigest()[:32]


@dataclass
class RescoreResult:
    source: str
    chosen: int = 0
    skipped: int = 0  # scored by this source before (a rerun)
    scored: int = 0
    failed: int = 0
    tampered: int = 0
    rewards: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # `EPISODE: error` of the first failures
    seconds: float = 0.0

    def line(self) -> str:
        mean = f"{statistics.fmean(self.rewards):.4f}" if self.rewards else "-"
        return (
            f"rescore {self.source}: {self.chosen} episodes chosen, {self.skipped} scored before (skipped), "
            f"{self.scored} scored, {self.failed} failed (flag {FLAG}), {self.tampered} tampered (reward 0), "
            f"mean reward {mean}  [{self.seconds:.1f}s]"
        )


@dataclass(frozen=True)
class _Episode:
    episode_id: str
    task: dict[str, Any]
    status: str
    exit_code: int | None
    tampered: bool
    workspace: Path | None  # collect's workdir, still on disk
    transcript: dict[str, Any]
    sandboxed: bool = False  # collected with --sandbox: verified in a sandbox whatever the flags say


@dataclass
class _Verdict:
    episode_id: str
    reward: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    output: str = ""
    tampered: bool = False


def rescore(store: Store, options: RescoreOptions, *, base: Path | None = None) -> RescoreResult | JudgeResult:
    """Score the episodes `options.where` picks with `options.verifier`; see the module docstring. A judge
    (`judge:RUBRIC.md`) is a pass of its own over them: `lcap.dataset.judge.run`."""
    if is_judge(options.verifier):
        if options.sandbox:
            raise LcapError(
                "--sandbox runs a verifier's process in a sandbox: a judge runs none (it needs the network)"
            )
        tasks_by_id = {t["id"]: t for t in load_tasks(options.tasks)} if options.tasks else {}
        chosen_ids = select_episodes(store, options.where or "")
        verifier_spec, source_name = options.verifier or "", options.source_name()
        return judge_episodes(
            store, chosen_ids, options, verifier_spec, source=source_name, tasks=tasks_by_id, base=base
        )
    started = time.perf_counter()
    verifier = load_verifier(options.verifier or "", base=base)
    verifier.timeout = options.timeout  # a command's, and a Python one's in a sandbox (a process there too)
    source = options.source_name()
    tasks = {t["id"]: t for t in load_tasks(options.tasks)} if options.tasks else {}
    chosen = select_episodes(store, options.where or "")
    keys = {episode: reward_key(source, episode) for episode in chosen}
    stored = {
        row[0]
        for row in store.fetchall(
            "SELECT key FROM rewards WHERE key IN (SELECT unnest(?::VARCHAR[]))", [list(keys.values())]
        )
    }
    pending = [episode for episode in chosen if keys[episode] not in stored]
    result = RescoreResult(source=source, chosen=len(chosen), skipped=len(chosen) - len(pending))
    writer = _Writer(store, source, keys, result)
    episodes = _episodes(store, pending, tasks)
    boxes = _Boxes.open(store, options, pending)
    shown = Reporter("rescore", len(pending), lambda: f"scored {result.scored}, failed {result.failed}")
    try:
        with shown, ThreadPoolExecutor(options.concurrency, thread_name_prefix="lcap-rescore") as pool:
            running: set[Future[_Verdict]] = set()
            try:
                for episode in episodes:
                    while len(running) >= options.concurrency:
                        running = _collect(running, writer, shown)
                    running.add(pool.submit(_score, verifier, episode, boxes))
                while running:
                    running = _collect(running, writer, shown)
            finally:  # an interrupt: what finished is stored, what did not start never starts
                for future in running:
                    future.cancel()
                writer.flush()
    finally:
        if boxes is not None:
            boxes.close()
    result.seconds = time.perf_counter() - started
    return result


class _NoNetwork:
    """The proxy of a sandbox that runs verifiers only: a verifier's sandbox has no network, nothing to serve."""

    port: int | None = None

    def serve_listener(self, episode_id: str, sock: socket.socket) -> AbstractContextManager[None]:
        raise LcapError("a verifier's sandbox has no network")


@dataclass
class _Boxes:
    """The sandbox rescore's sandboxed verifiers share, its scratch folder (hidden from them: each episode's
    transcript, stdout and empty workspace, each shown only to its own verifier), and the tasks' folder (their
    pristine tests)."""

    sandbox: Sandbox
    scratch: Path
    everything: bool  # --sandbox: every verifier, not only the sandboxed episodes'
    tasks_dir: Path | None

    @classmethod
    def open(cls, store: Store, options: RescoreOptions, episodes: list[str]) -> _Boxes | None:
        """The sandbox, where --sandbox is given or an episode was collected with it; else None. Refused in one
        line where it cannot run."""
        sandboxed, cwds = store.fetchall(_SANDBOXED, [episodes])[0] if episodes else (0, [])
        if not (options.sandbox or sandboxed):
            return None
        why = "--sandbox" if options.sandbox else f"{sandboxed} of these episodes were collected with --sandbox"
        if reason := missing():
            raise LcapError(f"rescore runs verifiers sandboxed ({why}): {reason}")
        limits = sandbox_limits(replace(options, sandbox=True))  # without --sandbox: the sandboxed episodes'
        assert limits is not None
        scratch = Path(tempfile.mkdtemp(prefix="lcap-rescore-"))
        runs = {Path(cwd).parent.parent for cwd in cwds or []}  # a collect's round folder: its episodes' folders
        try:
            sandbox = Sandbox(limits, _NoNetwork(), [scratch, *runs], [Path(store.path)], cache=scratch)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        tasks_dir = Path(options.tasks).resolve().parent if options.tasks else None
        return cls(sandbox, scratch, options.sandbox, tasks_dir)

    def close(self) -> None:
        self.sandbox.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _collect(running: set[Future[_Verdict]], writer: _Writer, shown: Reporter) -> set[Future[_Verdict]]:
    done, rest = wait(running, timeout=WRITE_AFTER_S, return_when=FIRST_COMPLETED)
    for future in done:
        writer.add(future.result())
        shown.advance()
    writer.flush_if_due()
    return rest


def _episodes(store: Store, ids: list[str], tasks: dict[str, dict[str, Any]]) -> Iterator[_Episode]:
    """The episodes to score with their transcripts, read a chunk at a time."""
    for start in range(0, len(ids), LOAD_CHUNK):
        chunk = ids[start : start + LOAD_CHUNK]
        with store.connect(read_only=True) as con:
            rows = con.execute(_EPISODES, [chunk]).fetchall()
            said = transcripts(con, chunk)
        by_id = {row[0]: row for row in rows}
        for episode_id in chunk:
            _, task_id, status, exit_code, flags, cwd, collect, sandboxed = by_id[episode_id]
            workspace = Path(cwd) if collect is not None and cwd and Path(cwd).is_dir() else None
            yield _Episode(
                episode_id=episode_id,
                task=tasks.get(str(task_id)) or {"id": task_id},
                status=status,
                exit_code=exit_code,
                tampered="tampered" in (flags or []),
                workspace=workspace,
                transcript=said[episode_id],
                sandboxed=bool(sandboxed),
            )


def _score(verifier: Verifier, episode: _Episode, boxes: _Boxes | None = None) -> _Verdict:
    if episode.tampered:
        return _Verdict(episode.episode_id, 0.0, {"tampered": True, "by": "tamper-guard"}, tampered=True)
    sandboxed = boxes is not None and (boxes.everything or episode.sandboxed)
    scratch_dir = tempfile.mkdtemp(prefix="ep-", dir=boxes.scratch if boxes is not None else None)
    try:
        scratch = Path(scratch_dir)
        transcript_file = scratch / "transcript.json"
        transcript_file.write_text(json.dumps(episode.transcript, ensure_ascii=False, default=str))
        transcript_file.chmod(0o644)  # a sandboxed verifier runs as nobody
        if episode.workspace is not None:
            workdir = episode.workspace
            stdout_file = workdir.parent / "stdout.txt"
            stdout = stdout_file.read_text(errors="replace") if stdout_file.is_file() else ""
        else:
            workdir = scratch / "work"
            workdir.mkdir()
            stdout_file = scratch / "stdout.txt"
            stdout_file.write_text("")
            stdout = ""
        ctx = VerifierContext(
            task=episode.task,
            episode_id=episode.episode_id,
            workdir=workdir,
            stdout=stdout,
            exit_code=episode.exit_code,
            status=episode.status,
            transcript=episode.transcript,
            transcript_file=transcript_file,
        )
        try:
            if sandboxed:
                assert boxes is not None
                verdict = _in_sandbox(verifier, ctx, episode, boxes, scratch, stdout_file)
            else:
                verdict = verifier(ctx)
        except VerifierError as exc:
            return _Verdict(episode.episode_id, error=str(exc), output=exc.output)
        except Exception as exc:  # a verifier's own failure is the episode's, never the run's
            return _Verdict(episode.episode_id, error=f"{exc.__class__.__name__}: {exc}")
    finally:
        if boxes is None:
            shutil.rmtree(scratch_dir, ignore_errors=True)
        else:  # its folders stay until the sandbox closes: another sandbox's set-up may be walking their mounts
            for name in ("transcript.json", "stdout.txt"):
                (Path(scratch_dir) / name).unlink(missing_ok=True)
    details = dict(verdict.details)
    if sandboxed:
        details["sandboxed"] = True
    return _Verdict(episode.episode_id, verdict.reward, details)


def _in_sandbox(
    verifier: Verifier, ctx: VerifierContext, episode: _Episode, boxes: _Boxes, scratch: Path, stdout_file: Path
) -> Verdict:
    """collect's sandboxed verifier over a copy of the episode's workspace (owned by the sandbox's user), its
    task's pristine tests put over it; shown its stdout and transcript."""
    tests = pristine_tests(episode.task, boxes.tasks_dir) if boxes.tasks_dir is not None else {}
    lower = boxes.sandbox.lower(ctx.workdir)
    shown = [p for p in (stdout_file, ctx.transcript_file) if p is not None and p.is_file()]
    return verify_in_sandbox(boxes.sandbox, verifier, ctx, scratch / "verify", lower=lower, tests=tests, shown=shown)


class _Writer:
    """Verdicts to the store in batches, one unit of work each: rewards (each with its key) and failure flags."""

    def __init__(self, store: Store, source: str, keys: dict[str, str], result: RescoreResult) -> None:
        self.store, self.source, self.keys, self.result = store, source, keys, result
        self.pending: list[_Verdict] = []
        self.since = time.monotonic()

    def add(self, verdict: _Verdict) -> None:
        if not self.pending:
            self.since = time.monotonic()
        self.pending.append(verdict)
        if len(self.pending) >= WRITE_EVERY:
            self.flush()

    def flush_if_due(self) -> None:
        if self.pending and time.monotonic() - self.since >= WRITE_AFTER_S:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        scored = [v for v in batch if v.error is None]
        with self.store.connect() as con:
            if scored:
                con.execute(
                    _STORE_VERDICTS,
                    {
                        "episodes": [v.episode_id for v in scored],
                        "values": [float(v.reward or 0.0) for v in scored],
                        "details": [json.dumps(v.details, default=str) for v in scored],
                        "source": self.source,
                        "at": now(),
                        "keys": [self.keys[v.episode_id] for v in scored],
                    },
                )
            for v in batch:
                if v.error is not None:
                    details = {"source": self.source, "error": v.error, "output": v.output[-OUTPUT_KEPT:]}
                    self.store.flag_episode(v.episode_id, FLAG, details)
        for v in batch:
            if v.error is not None:
                self.result.failed += 1
                if len(self.result.errors) < 5:
                    self.result.errors.append(f"{v.episode_id}: {v.error}")
            else:
                self.result.scored += 1
                self.result.tampered += v.tampered
                self.result.rewards.append(float(v.reward or 0.0))
