"""A judge pass: score stored episodes with an LLM judge and store its verdicts as rewards.

`judge_episodes` is what `--verifier judge:RUBRIC.md` runs, once the episodes are stored: after collect's agents
(collect and the loop's collect) and in `lcap rescore`. For each episode it reads the transcript from the store
(`transcripts`: the conversation of the agent's own calls), its task (with an optional `reference`) and its stdout
where collect kept it. In group mode the episodes of one task and round are judged in one call, relative to each
other; a lone episode is judged pointwise. Every prompt is checked against the judge's context before it is sent
(`plan.py`: `--judge-context`, capped by the endpoint's `max_model_len`): a group that does not fit one prompt (or
whose text is over `--judge-max-chars`) is judged in pairs, a Swiss tournament of O(n log n) calls whose standings
give the scores; an episode whose prompt does not fit even alone is left unrewarded with that reason (flag
`judge_error`, `too_long`). A reward's details say which mode judged it (`judge_mode`: group, pairs, pointwise).

Every verdict is cached in `judge_cache` by (rubric hash, judge model, hash of what the judge was shown): judging
the same episodes again with the same rubric and model calls nothing, and a changed rubric judges again. Rewards
carry an idempotency key of (source, rubric, model, episode). A judge call that fails, times out or answers
nonsense leaves its episodes unrewarded with flag `judge_error` (the reason, the judge episode): never reward 0.
Each judge call is an episode of its own (label `role=judge`, `judged`: the episode ids it judged), made through
a capture proxy of this pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from lcap.capture import ProxyOptions
from lcap.dataset.build.export import transcripts
from lcap.dataset.judge.client import (
    MODELS_TIMEOUT_S,
    Endpoint,
    JudgeCallError,
    JudgeClient,
    model_context,
    resolve_endpoint,
)
from lcap.dataset.judge.plan import Budget, Swiss, pair_result
from lcap.dataset.judge.prompt import (
    POINTWISE_SCHEMA,
    REASONS_MAX,
    JudgeAnswerError,
    Rubric,
    Sample,
    group_order,
    group_prompt,
    group_regex,
    group_schema,
    parse_group,
    parse_pointwise,
    pointwise_prompt,
    pointwise_regex,
    shown_size,
)
from lcap.dataset.options import JudgeOptions
from lcap.store import Store, now

log = logging.getLogger("lcap.dataset")

FLAG = "judge_error"
ROLE = "judge"  # the `role` label of a judge call's own episode
ERRORS_SHOWN = 5
LOAD_CHUNK = 64

_EPISODES = """
SELECT s.episode_id, s.task_id, s.round, s.flags, e.cwd, e.labels->>'role' AS role
FROM episode_summary s JOIN episodes e USING (episode_id)
WHERE s.episode_id IN (SELECT unnest(?::VARCHAR[]))
"""
_CACHED = """
SELECT transcript_hash, score, details FROM judge_cache
WHERE rubric_hash = ? AND judge_model = ? AND transcript_hash IN (SELECT unnest(?::VARCHAR[]))
QUALIFY row_number() OVER (PARTITION BY transcript_hash ORDER BY created_at) = 1
"""


def reward_key(source: str, rubric: Rubric, model: str, episode_id: str) -> str:
    """The idempotency key of a judge's reward of an episode: a changed rubric or model is a new reward."""
    blob = "\0".join((source, rubric.digest, model, episode_id))
    return "judge:" + hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass
class JudgeResult:
    source: str
    chosen: int = 0
    skipped: int = 0  # rewarded by this source, rubric and model before
    judged: int = 0  # rewarded from a judge call of this pass
    cached: int = 0  # rewarded from the cache, no call
    failed: int = 0  # flag judge_error, left unrewarded
    too_long: int = 0  # of the failed: a prompt over the judge's context even alone, never sent
    tampered: int = 0  # collect's tamper guard flagged it: reward 0, not judged
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    call_seconds: float = 0.0
    seconds: float = 0.0
    rewards: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def rewarded(self) -> int:
        return self.judged + self.cached + self.tampered

    def line(self) -> str:
        mean = f"{statistics.fmean(self.rewards):.4f}" if self.rewards else "-"
        return (
            f"judge {self.source}: {self.chosen} episodes, {self.skipped} judged before (skipped), {self.judged} "
            f"judged, {self.cached} from the cache, {self.failed} failed (flag {FLAG}, unrewarded{self._too_long()}), "
            f"{self.tampered} tampered (reward 0), mean reward {mean}; {self.calls} judge calls, "
            f"{self.prompt_tokens} prompt + {self.completion_tokens} answer tokens, {self.call_seconds:.1f}s in calls "
            f"[{self.seconds:.1f}s]"
        )

    def _too_long(self) -> str:
        return f", {self.too_long} too long for the judge's context" if self.too_long else ""


@dataclass(frozen=True)
class JudgeJob:
    """One judge call (a group, or one sample), or a group's tournament of pairwise calls; each episode's cache
    hash."""

    mode: str  # group | pairs | pointwise
    labelled: list[tuple[str, Sample]]
    hashes: dict[str, str]  # episode id -> transcript hash


@dataclass
class _Outcome:
    job: JudgeJob
    scores: dict[str, tuple[float, str]] = field(default_factory=dict)  # episode id -> (score, reasons)
    error: str | None = None
    judge_episode: str | None = None
    cached: bool = False
    tokens: tuple[int, int] = (0, 0)
    seconds: float = 0.0
    calls: int = 1
    more: dict[str, dict[str, Any]] = field(default_factory=dict)  # episode id -> more of its reward's details


def check_judge(spec: str, options: JudgeOptions, base: Path | None = None) -> tuple[Rubric, Endpoint]:
    """The rubric and the endpoint, or a one-line error: before any agent runs."""
    return Rubric.load(spec, base), resolve_endpoint(options)


def judge_episodes(
    store: Store,
    episode_ids: Sequence[str],
    options: JudgeOptions,
    spec: str,
    *,
    source: str,
    tasks: Mapping[str, Mapping[str, Any]] | None = None,
    base: Path | None = None,
) -> JudgeResult:
    """Judge `episode_ids` with the rubric of `spec` (`judge:RUBRIC.md`); their rewards are stored under `source`.
    `tasks`: the tasks by id (a task's `reference` is shown to the judge); see the module docstring."""
    started = time.perf_counter()
    rubric, endpoint = check_judge(spec, options, base)
    result = JudgeResult(source=source)
    samples, tampered = _load(store, list(episode_ids), tasks or {})
    result.chosen = len(samples) + len(tampered)
    keys = {
        eid: reward_key(source, rubric, endpoint.model, eid) for eid in [*(s.episode_id for s in samples), *tampered]
    }
    done = {
        row[0]
        for row in store.fetchall("SELECT key FROM rewards WHERE key IN (SELECT unnest(?))", [list(keys.values())])
    }
    result.skipped = sum(1 for key in keys.values() if key in done)
    with store.connect():
        for eid in tampered:
            if keys[eid] not in done:
                _reward(store, eid, 0.0, {"tampered": True, "by": "tamper-guard"}, source, keys[eid])
                result.tampered += 1
                result.rewards.append(0.0)
    pending = [s for s in samples if keys[s.episode_id] not in done]
    budget = judge_budget(endpoint, options) if pending else Budget(options.judge_context, options.judge_max_tokens)
    jobs, refused = plan_jobs(pending, options, rubric, budget)
    _refuse(store, refused, result)
    calls = _from_cache(store, rubric, endpoint, jobs, keys, result)
    if calls:
        _call_all(store, calls, rubric, endpoint, options, keys, result, budget)
    result.seconds = time.perf_counter() - started
    return result


def judge_budget(endpoint: Endpoint, options: JudgeOptions) -> Budget:
    """The judge's context: --judge-context, capped by the max_model_len its endpoint reports (every judge's rule:
    a judge pass's and the implicit judge's)."""
    reported = model_context(endpoint, min(options.judge_timeout, MODELS_TIMEOUT_S))
    context = min(options.judge_context, reported) if reported else options.judge_context
    return Budget(context, options.judge_max_tokens)


def _load(store: Store, ids: list[str], tasks: Mapping[str, Mapping[str, Any]]) -> tuple[list[Sample], list[str]]:
    """The samples to judge and the tampered episodes; judge episodes are never judged themselves."""
    samples: list[Sample] = []
    tampered: list[str] = []
    for start in range(0, len(ids), LOAD_CHUNK):
        chunk = ids[start : start + LOAD_CHUNK]
        with store.connect(read_only=True) as con:
            rows = con.execute(_EPISODES, [chunk]).fetchall()
            said = transcripts(con, chunk)
        for episode_id, task_id, round_, flags, cwd, role in rows:
            if role == ROLE:
                continue
            if "tampered" in (flags or []):
                tampered.append(episode_id)
                continue
            task = dict(tasks.get(str(task_id)) or {"id": task_id})
            task.setdefault("round", round_)
            stdout_file = Path(cwd).parent / "stdout.txt" if cwd else None
            stdout = stdout_file.read_text(errors="replace") if stdout_file and stdout_file.is_file() else ""
            samples.append(Sample(episode_id, task, said.get(episode_id) or {}, stdout))
    return samples, tampered


def plan_jobs(
    samples: list[Sample], options: JudgeOptions, rubric: Rubric, budget: Budget
) -> tuple[list[JudgeJob], dict[str, str]]:
    """The jobs, and the episodes too long for the judge's context even alone (id -> why). In group mode a group
    (same task and round) is one call where its text is within --judge-max-chars and its prompt fits the context;
    else a tournament of pairs where every pair's prompt fits; else (and a lone sample) pointwise."""
    groups: dict[tuple[str, str], list[Sample]] = {}
    for sample in samples:
        groups.setdefault((str(sample.task.get("id")), str(sample.task.get("round"))), []).append(sample)
    jobs: list[JudgeJob] = []
    refused: dict[str, str] = {}
    chars = options.judge_max_chars
    for members in groups.values():
        fitting = []
        for s in members:
            alone = pointwise_prompt(rubric, s, chars)
            if budget.fits(alone):
                fitting.append(s)
            else:
                refused[s.episode_id] = budget.too_long(alone, 1, "its prompt alone")
        mode = _group_mode(fitting, rubric, budget, chars) if options.judge_mode == "group" else "pointwise"
        if mode == "pointwise":
            jobs.extend(JudgeJob("pointwise", [("1", s)], {s.episode_id: s.digest()}) for s in fitting)
            continue
        labelled = group_order(fitting)
        whole = hashlib.sha256("\0".join(f"{label}:{s.digest()}" for label, s in labelled).encode()).hexdigest()
        hashes = {
            s.episode_id: hashlib.sha256(f"{mode}\0{whole}\0{label}".encode()).hexdigest() for label, s in labelled
        }
        jobs.append(JudgeJob(mode, labelled, hashes))
    return jobs, refused


def _group_mode(samples: list[Sample], rubric: Rubric, budget: Budget, chars: int) -> str:
    """group, pairs or pointwise: the first that fits. A pair's prompt is longest with its longest sample twice
    (each of a pair is quoted within half of --judge-max-chars), so that pair fitting is every pair fitting."""
    if len(samples) < 2:
        return "pointwise"
    if sum(shown_size(s) for s in samples) <= chars and budget.fits(
        group_prompt(rubric, group_order(samples), chars), len(samples)
    ):
        return "group"
    if all(budget.fits(group_prompt(rubric, [("1", s), ("2", s)], chars), 2) for s in samples):
        return "pairs"
    return "pointwise"


def _refuse(store: Store, refused: Mapping[str, str], result: JudgeResult) -> None:
    """The episodes too long for the judge's context: flag judge_error with the reason, unrewarded, no call."""
    if not refused:
        return
    with store.connect():
        for eid, why in refused.items():
            store.flag_episode(eid, FLAG, {"source": result.source, "error": why, "too_long": True})
            result.failed += 1
            result.too_long += 1
            if len(result.errors) < ERRORS_SHOWN:
                result.errors.append(f"{eid}: {why}")


def _from_cache(
    store: Store, rubric: Rubric, endpoint: Endpoint, jobs: list[JudgeJob], keys: dict[str, str], result: JudgeResult
) -> list[JudgeJob]:
    """Reward what the cache holds (every episode of a job, or none of it); return the jobs left to call."""
    hashes = [h for job in jobs for h in job.hashes.values()]
    rows = store.fetchall(_CACHED, [rubric.digest, endpoint.model, hashes]) if hashes else []
    cached = {h: (score, json.loads(details or "{}")) for h, score, details in rows}
    left = []
    with store.connect():
        for job in jobs:
            if not all(h in cached for h in job.hashes.values()):
                left.append(job)
                continue
            for eid, h in job.hashes.items():
                score, details = cached[h]
                _reward(store, eid, score, {**details, "cached": True}, result.source, keys[eid])
                result.cached += 1
                result.rewards.append(score)
    return left


def _call_all(
    store: Store,
    jobs: list[JudgeJob],
    rubric: Rubric,
    endpoint: Endpoint,
    options: JudgeOptions,
    keys: dict[str, str],
    result: JudgeResult,
    budget: Budget,
) -> None:
    """Make the judge calls, `--judge-concurrency` at once, through a capture proxy of this pass; store each
    outcome as it arrives. A call's completion may queue more (a tournament's next round)."""
    from lcap.capture import CaptureProxy  # start-up: mitmproxy (rescore without a judge needs none)

    client = JudgeClient(endpoint, options)
    proxy = CaptureProxy(store, ProxyOptions())
    proxy.start()
    chars = options.judge_max_chars
    queue: deque[tuple[Callable[[], Any], Callable[[Any], None]]] = deque()

    def done(outcome: _Outcome) -> None:
        _store(store, outcome, rubric, endpoint, keys, result)

    for job in jobs:
        if job.mode == "pairs":
            _Tournament(job, partial(_compare, store, proxy, client, rubric, chars, budget), queue.append, done).next()
        else:
            queue.append((partial(_judge, store, proxy, client, rubric, job, chars), done))
    try:
        with ThreadPoolExecutor(options.judge_concurrency, thread_name_prefix="lcap-judge") as pool:
            running: dict[Future[Any], Callable[[Any], None]] = {}
            try:
                while queue or running:
                    while queue and len(running) < options.judge_concurrency:
                        call, then = queue.popleft()
                        running[pool.submit(call)] = then
                    finished, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                    for future in finished:
                        running.pop(future)(future.result())
            finally:  # an interrupt: what finished is stored, what did not start never starts
                for future in running:
                    future.cancel()
    finally:
        proxy.stop()


def _judge(store: Store, proxy: Any, client: JudgeClient, rubric: Rubric, job: JudgeJob, budget: int) -> _Outcome:
    """One judge call of `job` (`budget`: characters of quoted episodes); its verdicts, or why there are none."""
    judged = [s.episode_id for _, s in job.labelled]
    labels = {"judged": ",".join(judged), "judge_mode": job.mode}
    if job.mode == "group":
        names = [label for label, _ in job.labelled]
        messages, schema, regex = group_prompt(rubric, job.labelled, budget), group_schema(names), group_regex(names)

        def parse(content: str) -> dict[str, tuple[float, str]]:
            by_label = parse_group(content, names)
            return {s.episode_id: by_label[label] for label, s in job.labelled}
    else:
        messages = pointwise_prompt(rubric, job.labelled[0][1], budget)
        schema, regex = POINTWISE_SCHEMA, pointwise_regex()

        def parse(content: str) -> dict[str, tuple[float, str]]:
            return {judged[0]: parse_pointwise(content)}

    call = judge_call(store, proxy, client, rubric, labels, (messages, schema, regex), parse, answers=len(judged))
    outcome = _Outcome(job, judge_episode=call.judge_episode, error=call.error, tokens=call.tokens)
    outcome.scores, outcome.seconds = call.value or {}, call.seconds
    return outcome


def _compare(
    store: Store, proxy: Any, client: JudgeClient, rubric: Rubric, chars: int, budget: Budget, pair: list[Sample]
) -> JudgeCall:
    """One pairwise call of a tournament: the two samples as a group of two (shuffled by their ids); its value
    {episode id: (score, reasons)}. A prompt over the context is not sent: the call's error says why."""
    labelled = group_order(pair)
    names = [label for label, _ in labelled]
    messages = group_prompt(rubric, labelled, chars)
    labels = {"judged": ",".join(s.episode_id for _, s in labelled), "judge_mode": "pairs"}
    if not budget.fits(messages, 2):
        return JudgeCall(judge_episode="", error=budget.too_long(messages, 2, "a comparison"))

    def parse(content: str) -> dict[str, tuple[float, str]]:
        by_label = parse_group(content, names)
        return {s.episode_id: by_label[label] for label, s in labelled}

    prompt = (messages, group_schema(names), group_regex(names))
    return judge_call(store, proxy, client, rubric, labels, prompt, parse, answers=2)


class _Tournament:
    """A group judged in pairs (`plan.Swiss`): each round's pairwise calls are queued (`enqueue`) when the round
    before is all in; the scores, once every round is, go to `finish` as one outcome. A call that fails ends the
    tournament (no more rounds) and leaves the whole group unrewarded with its reason, as a failed group call."""

    def __init__(
        self,
        job: JudgeJob,
        compare: Callable[[list[Sample]], JudgeCall],
        enqueue: Callable[[tuple[Callable[[], Any], Callable[[Any], None]]], None],
        finish: Callable[[_Outcome], None],
    ) -> None:
        self.job, self.compare, self.enqueue, self.finish = job, compare, enqueue, finish
        self.samples = dict(job.labelled)
        self.swiss = Swiss([label for label, _ in job.labelled])
        self.outcome = _Outcome(job, calls=0)
        self.waiting = 0
        self.said: dict[str, list[str]] = {label: [] for label in self.samples}
        self.calls: dict[str, list[str]] = {label: [] for label in self.samples}

    def next(self) -> None:
        """Queue the next round's calls, or finish."""
        pairs = self.swiss.pairs() if self.outcome.error is None else []
        if not pairs:
            self._finish()
            return
        self.waiting = len(pairs)
        for first, second in pairs:
            call = partial(self.compare, [self.samples[first], self.samples[second]])
            self.enqueue((call, partial(self._record, first, second)))

    def _record(self, first: str, second: str, call: JudgeCall) -> None:
        outcome = self.outcome
        if call.judge_episode:
            outcome.calls += 1
            outcome.tokens = (outcome.tokens[0] + call.tokens[0], outcome.tokens[1] + call.tokens[1])
            outcome.seconds += call.seconds
        if call.error is not None:
            if outcome.error is None:
                outcome.error = f"{self.samples[first].episode_id} vs {self.samples[second].episode_id}: {call.error}"
                outcome.judge_episode = call.judge_episode or None
        else:
            verdicts = call.value
            a, b = verdicts[self.samples[first].episode_id], verdicts[self.samples[second].episode_id]
            self.swiss.record(first, second, pair_result(a[0], b[0]))
            for label, (_, reasons) in ((first, a), (second, b)):
                self.said[label].append(reasons)
                self.calls[label].append(call.judge_episode)
        self.waiting -= 1
        if self.waiting == 0:
            self.next()

    def _finish(self) -> None:
        outcome = self.outcome
        if outcome.error is None:
            for label, score in self.swiss.scores().items():
                eid = self.samples[label].episode_id
                outcome.scores[eid] = (score, " | ".join(r for r in self.said[label] if r)[:REASONS_MAX])
                outcome.more[eid] = {
                    "tournament": "swiss",
                    "pair_points": self.swiss.points[label],
                    "pairs_against": [self.samples[o].episode_id for o in self.swiss.met[label]],
                    "judge_episodes": self.calls[label],
                    "judge_episode": self.calls[label][-1] if self.calls[label] else None,
                }
        self.finish(outcome)


@dataclass
class JudgeCall:
    """One judge call's parsed answer (`value`), or why there is none (`error`), and what it cost."""

    judge_episode: str
    value: Any = None
    error: str | None = None
    tokens: tuple[int, int] = (0, 0)
    seconds: float = 0.0


def judge_call(
    store: Store,
    proxy: Any,
    client: JudgeClient,
    rubric: Rubric,
    labels: Mapping[str, str],
    prompt: tuple[list[dict[str, str]], dict[str, Any], str],
    parse: Callable[[str], Any],
    *,
    answers: int = 1,
) -> JudgeCall:
    """One judge call (`prompt`: the messages, the answer's schema and regular expression) through `proxy`, as an
    episode of its own labelled `role=judge` with `labels`; its answer read by `parse`, which raises
    JudgeAnswerError on nonsense. Never raises for the call: a failure is the call's `error`."""
    call = JudgeCall(judge_episode=f"judge-{secrets.token_hex(10)}")
    labels = {
        "role": ROLE,
        **labels,
        "judge_model": client.endpoint.model,
        "rubric": rubric.path.name,
        "rubric_sha256": rubric.digest[:16],
    }
    store.start_episode(call.judge_episode, command="lcap judge", cwd=None, labels=labels)
    try:
        messages, schema, regex = prompt
        answer = client.ask(messages, schema, regex, proxy.proxy_url(call.judge_episode), answers=answers)
        call.tokens, call.seconds = (answer.prompt_tokens, answer.completion_tokens), answer.seconds
        call.value = parse(answer.content)
    except (JudgeCallError, JudgeAnswerError) as exc:
        call.error = str(exc)
    except Exception as exc:  # lcap's own failure on one call: the episode's, never the pass's
        log.warning("lcap: judge call %s failed", call.judge_episode, exc_info=True)
        call.error = f"{exc.__class__.__name__}: {exc}"
    if not proxy.flush(call.judge_episode):
        log.warning("lcap: judge episode %s: its call is not in the store yet", call.judge_episode)
    store.end_episode(call.judge_episode, status="ok" if call.error is None else "error", error=call.error)
    return call


def _store(
    store: Store, outcome: _Outcome, rubric: Rubric, endpoint: Endpoint, keys: dict[str, str], result: JudgeResult
) -> None:
    """One job's verdicts as rewards and cache rows, or its episodes' judge_error flags, in one unit of work."""
    job = outcome.job
    result.calls += outcome.calls
    result.prompt_tokens += outcome.tokens[0]
    result.completion_tokens += outcome.tokens[1]
    result.call_seconds += outcome.seconds
    with store.connect():
        if outcome.error is not None:
            for eid in job.hashes:
                why = {"source": result.source, "error": outcome.error, "judge_episode": outcome.judge_episode}
                store.flag_episode(eid, FLAG, why)
                result.failed += 1
            if len(result.errors) < ERRORS_SHOWN:
                result.errors.append(f"{', '.join(job.hashes)}: {outcome.error}")
            return
        rows = []
        for eid, (score, reasons) in outcome.scores.items():
            details = {
                "score": score,
                "reasons": reasons,
                "judge_mode": job.mode,
                "judge_model": endpoint.model,
                "rubric": str(rubric.path),
                "rubric_sha256": rubric.digest,
                "judge_episode": outcome.judge_episode,
                **outcome.more.get(eid, {}),
            }
            _reward(store, eid, score, details, result.source, keys[eid])
            rows.append(
                {
                    "rubric_hash": rubric.digest,
                    "judge_model": endpoint.model,
                    "transcript_hash": job.hashes[eid],
                    "mode": job.mode,
                    "episode_id": eid,
                    "score": score,
                    "details": json.dumps(details),
                    "created_at": now(),
                }
            )
            result.judged += 1
            result.rewards.append(score)
        store.append("judge_cache", rows)


def _reward(store: Store, episode_id: str, score: float, details: dict[str, Any], source: str, key: str) -> None:
    store.add_reward(episode_id, float(score), details=json.dumps(details, default=str), source=source, key=key)
