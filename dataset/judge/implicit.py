"""Implicit rewards from live traffic: the user's next message in a session, judged as feedback on the assistant
turn before it (satisfied, corrected, abandoned), stored as a late reward of source `implicit`.

`lcap judge-live judge:RUBRIC.md` watches the store: every `--poll` seconds it reads the turns that ended within
`--lookback` hours whose request ends with a user message right after an assistant message (chat and Anthropic
Messages requests, which carry their whole conversation; a tool result is not a user message), not judged yet
with this rubric and model, the oldest `--batch` first. Each is one pointwise judge call (prompt.py's
`feedback_prompt`: the earlier conversation, the assistant turn and the user's message, all quoted as data)
through a capture proxy of its own, stored as an episode labelled `role=judge`; the verdict is a reward of the
session's episode with source `implicit` and the key `implicit:TURN:RUBRIC:MODEL` (TURN: the call that carried the
user's message), through `Store.add_reward` as `POST /lcap/v1/rewards` stores one: judging again stores nothing
twice. A judge that fails, times out or answers nonsense leaves the turn unrewarded with flag `judge_error` (the
reason, the key), which keeps it out of later looks; so does a prompt over the judge's context (run.py's
`judge_budget`: `--judge-context`, capped by the endpoint's `max_model_len`), which is never sent (its flag says
`too_long`). An episode's latest reward is what training reads, so a session's reward is the feedback on its
latest judged turn.

`lcap proxy --serve --implicit-reward SPEC` runs this command as a child process (`python -m lcap judge-live`,
capture never imports this stage) and ends it with the proxy: it closes the child's standard input.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from lcap.capture import CaptureProxy, ProxyOptions
from lcap.dataset.build.rebuild import chat_from_anthropic
from lcap.dataset.judge.client import JudgeClient
from lcap.dataset.judge.prompt import FEEDBACK_SCHEMA, Rubric, feedback_prompt, feedback_regex, parse_feedback
from lcap.dataset.judge.run import FLAG, ROLE, check_judge, judge_budget, judge_call
from lcap.dataset.options import ImplicitOptions
from lcap.store import Store, now

log = logging.getLogger("lcap.dataset")

SOURCE = "implicit"
READY = "lcap judge-live: watching"  # the first line on stdout, once the rubric and the endpoint are checked
ERRORS_SHOWN = 5

# Turns whose request's last message is the user's, right after an assistant message, not judged (rewarded or
# failed) under this key suffix. A session's calls only: never a judge's own episode or a collect's.
_WAITING = """
SELECT t.turn_id, t.episode_id, t.seq, t.dialect, t.request::VARCHAR
FROM turns t JOIN episodes e USING (episode_id)
WHERE t.ended_at >= $since AND t.dialect IN ('chat', 'messages')
  AND t.error IS NULL AND coalesce(t.status_code, 200) < 400
  AND coalesce(e.labels->>'role', '') <> $role AND e.labels->>'collect' IS NULL
  AND json_extract_string(t.request, '$.messages[#-1].role') = 'user'
  AND json_extract_string(t.request, '$.messages[#-2].role') = 'assistant'
  AND NOT list_contains(coalesce(json_extract_string(t.request, '$.messages[#-1].content[*].type'), []),
                        'tool_result')
  AND NOT EXISTS (SELECT 1 FROM rewards r
                  WHERE r.episode_id = t.episode_id AND r.key = 'implicit:' || t.turn_id || ':' || $suffix)
  AND NOT EXISTS (SELECT 1 FROM episode_flags f
                  WHERE f.episode_id = t.episode_id AND f.flag = $flag
                    AND f.details->>'key' = 'implicit:' || t.turn_id || ':' || $suffix)
ORDER BY t.ended_at, t.turn_id
LIMIT $batch
"""


def key_suffix(rubric: Rubric, model: str) -> str:
    """What a changed rubric or judge model changes in a turn's key: it is judged again."""
    return f"{rubric.digest[:16]}:{hashlib.sha256(model.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class Feedback:
    """One judged turn: the user's message in the request of call `turn_id`, on the assistant message before it."""

    turn_id: str
    episode_id: str
    seq: int
    earlier: list[dict[str, Any]]
    reply: dict[str, Any]
    message: Any  # the user's message's content, as sent

    def key(self, suffix: str) -> str:
        return f"implicit:{self.turn_id}:{suffix}"


# what `ImplicitJudge._judge` makes of a waiting turn: (turn, verdict, error, judge episode, too long)
Judged = tuple[Feedback | None, tuple[float, str, str] | None, str | None, str | None, bool]


@dataclass
class ImplicitResult:
    looks: int = 0
    judged: int = 0
    skipped: int = 0  # rewarded under this key already (another judge of the same store got there first)
    failed: int = 0  # flag judge_error, left unrewarded
    too_long: int = 0  # of the failed: a prompt over the judge's context, never sent
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    feedback: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        said = ", ".join(f"{n} {kind}" for kind, n in sorted(self.feedback.items())) or "none"
        return (
            f"judge-live: {self.judged} turns judged (source {SOURCE}; feedback: {said}), {self.skipped} judged "
            f"before, {self.failed} failed (flag {FLAG}, unrewarded{self._too_long()}); {self.calls} judge calls, "
            f"{self.prompt_tokens} "
            f"prompt + {self.completion_tokens} answer tokens, {self.looks} looks at the store"
        )

    def _too_long(self) -> str:
        return f", {self.too_long} too long for the judge's context" if self.too_long else ""


def read_feedback(row: tuple) -> Feedback | str:
    """The turn of a `_WAITING` row as a Feedback, or why it cannot be judged."""
    turn_id, episode_id, seq, dialect, request = row
    try:
        body = json.loads(request)
        messages = body["messages"] if dialect == "chat" else chat_from_anthropic(body)[0]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its request cannot be read: {exc.__class__.__name__}"
    if len(messages) < 2 or not all(isinstance(m, dict) for m in messages[-2:]):
        return "no assistant message before the user's"
    last, reply = messages[-1], messages[-2]
    if last.get("role") != "user" or reply.get("role") != "assistant" or not last.get("content"):
        return "its request does not end with a user's message after an assistant's"
    earlier = [m for m in messages[:-2] if isinstance(m, dict)]
    return Feedback(str(turn_id), str(episode_id), int(seq), earlier, reply, last.get("content"))


class ImplicitJudge:
    """The watcher: one capture proxy for its judge calls, kept while it runs; `look` judges one batch."""

    def __init__(self, store: Store, spec: str, options: ImplicitOptions) -> None:
        self.store, self.options = store, options
        self.rubric, self.endpoint = check_judge(spec, options)
        self.client = JudgeClient(self.endpoint, options)
        self.suffix = key_suffix(self.rubric, self.endpoint.model)
        self.budget = judge_budget(self.endpoint, options)
        self.result = ImplicitResult()
        self._lock = threading.Lock()  # the result's counters, added to by the judge threads
        self.proxy: Any = None

    def __enter__(self) -> ImplicitJudge:
        # Not announced: `lcap episode new` beside a serving proxy finds that proxy alone.
        self.proxy = CaptureProxy(self.store, ProxyOptions(rewards_port=-1), announce=False)
        self.proxy.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.stop()

    def look(self) -> int:
        """Judge the oldest turns waiting (at most --batch), --judge-concurrency at once; how many were waiting."""
        self.result.looks += 1
        since = now() - timedelta(hours=self.options.lookback)
        params = {"since": since, "role": ROLE, "flag": FLAG, "suffix": self.suffix, "batch": self.options.batch}
        rows = self.store.fetchall(_WAITING, params)
        with ThreadPoolExecutor(self.options.judge_concurrency, thread_name_prefix="lcap-judge-live") as pool:
            for row, outcome in zip(rows, pool.map(self._judge, rows), strict=True):
                self._store(row, *outcome)
        return len(rows)

    def _judge(self, row: tuple) -> Judged:
        """(the turn, its verdict or None, the error or None, the judge episode, whether it was too long for the
        judge's context) of one waiting turn."""
        turn = read_feedback(row)
        if isinstance(turn, str):
            return None, None, f"not judged: {turn}", None, False
        labels = {"judged": turn.episode_id, "judged_turn": turn.turn_id, "judge_mode": "implicit"}
        prompt = feedback_prompt(self.rubric, turn.earlier, turn.reply, turn.message, self.options.judge_max_chars)
        if not self.budget.fits(prompt):  # never sent: the endpoint would refuse it, or cut what it judges
            return turn, None, self.budget.too_long(prompt, 1, "the turn's prompt"), None, True
        call = judge_call(
            self.store,
            self.proxy,
            self.client,
            self.rubric,
            labels,
            (prompt, FEEDBACK_SCHEMA, feedback_regex()),
            parse_feedback,
        )
        with self._lock:
            self.result.calls += 1
            self.result.prompt_tokens += call.tokens[0]
            self.result.completion_tokens += call.tokens[1]
        return turn, call.value, call.error, call.judge_episode, False

    def _store(
        self,
        row: tuple,
        turn: Feedback | None,
        verdict: tuple[float, str, str] | None,
        error: str | None,
        judge_episode: str | None,
        too_long: bool,
    ) -> None:
        turn_id, episode_id, seq = str(row[0]), str(row[1]), int(row[2])
        key = f"implicit:{turn_id}:{self.suffix}"
        if verdict is None:
            why = {"source": SOURCE, "key": key, "turn": turn_id, "error": error, "judge_episode": judge_episode}
            self.store.flag_episode(episode_id, FLAG, {**why, "too_long": True} if too_long else why)
            self.result.failed += 1
            self.result.too_long += too_long
            if len(self.result.errors) < ERRORS_SHOWN:
                self.result.errors.append(f"{episode_id} call {seq}: {error}")
            return
        score, reasons, feedback = verdict
        details = {
            "score": score,
            "feedback": feedback,
            "reasons": reasons,
            "turn": turn_id,
            "seq": seq,
            "judge_mode": "implicit",
            "judge_model": self.endpoint.model,
            "rubric": str(self.rubric.path),
            "rubric_sha256": self.rubric.digest,
            "judge_episode": judge_episode,
        }
        stored = self.store.add_reward(episode_id, score, details=json.dumps(details), source=SOURCE, key=key)
        if stored:
            self.result.judged += 1
            self.result.feedback[feedback] = self.result.feedback.get(feedback, 0) + 1
        else:
            self.result.skipped += 1


def judge_live(store: Store, spec: str, options: ImplicitOptions, *, echo: Any = print) -> ImplicitResult:
    """Run the watcher (see the module docstring) until stopped: Ctrl-C, SIGTERM (the caller's), standard input
    closing with --until-stdin-closes; with --once, until nothing is waiting."""
    stop = threading.Event()
    if options.until_stdin_closes:
        threading.Thread(target=_until_eof, args=(stop,), name="lcap-stdin", daemon=True).start()
    with ImplicitJudge(store, spec, options) as judge:
        echo(
            f"{READY} {store.path} (rubric {judge.rubric.path}, judge {judge.endpoint.model}, every {options.poll:g}s)"
        )
        while not stop.is_set():
            waiting = judge.look()
            if waiting:
                log.info("lcap: %s", judge.result.line())
            if options.once and waiting < options.batch:
                break
            if waiting < options.batch:  # a full batch: more may be waiting, look again at once
                stop.wait(options.poll)
    return judge.result


def _until_eof(stop: threading.Event) -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    stop.set()
