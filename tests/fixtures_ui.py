"""Fixtures of the UI tests: a real DuckDB store written through `Store.append` as the stages write it
(every dialect's request shape, tool calls, reasoning, token ids from a real tokenizer file, rewards,
flags, training and loop records), a running `lcap ui` server, and headless Chromium via Playwright."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from lcap.store import Store

LCAP = str(Path(sys.executable).with_name("lcap"))
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
# Untrusted text that would run if the UI ever rendered it as HTML.
XSS = '<script>window.__xss = 1</script><img src="x" onerror="window.__xss = 2">'
_T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

SYSTEM = "You are a calculator agent. Use the calc tool."
QUESTION = "What is 12 * 7?"
ANSWER = "The answer is 84."
CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def make_tokenizer(folder: Path):
    """A small byte-level BPE tokenizer (the kind Qwen uses) saved as folder/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [SYSTEM, QUESTION, ANSWER, "calc", '{"expression": "12 * 7"}', "84", "system user assistant tool"] * 5
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


class UiStore:
    """Writes a store the way capture, collect, train and the loop do, through `Store.append`."""

    def __init__(self, store, tokenizer) -> None:
        self.store, self.tok, self.clock = store, tokenizer, 0

    def tick(self, seconds: float = 1.0) -> datetime:
        self.clock += seconds
        return _T0 + timedelta(seconds=self.clock)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def episode(
        self,
        episode_id: str,
        turns: list[dict],
        *,
        task: str | None = "calc-1",
        round: int | None = 1,
        split: str = "train",
        sample: int = 0,
        status: str = "ok",
        reward: float | None = None,
        details: dict | None = None,
        flags: tuple[str, ...] = (),
        command: str = "python agent.py",
    ) -> None:
        started = self.tick()
        labels = {
            k: str(v)
            for k, v in (("task", task), ("round", round), ("sample", sample), ("split", split))
            if v is not None
        }
        rows = []
        for seq, turn in enumerate(turns):
            begin = self.tick(0.5)
            row = {
                "turn_id": f"{episode_id}/t{seq}",
                "episode_id": episode_id,
                "seq": seq,
                "started_at": begin,
                "ended_at": self.tick(0.4),
                "latency_ms": 400.0 + 10 * seq,
                "ttft_ms": 120.0 + seq,
                "host": "api.openai.com",
                "path": "/v1/chat/completions",
                "dialect": "chat",
                "transport": "http",
                "stream": False,
                "upstream": "http://127.0.0.1:8000/v1",
                "model_requested": "gpt-4o-mini",
                "model_served": "policy-r1",
                "deployment": "policy-r1",
                "status_code": 200,
                "finish_reason": "stop",
                "token_source": "vllm",
            }
            row.update(turn)
            for key in ("request", "response", "tool_calls"):
                if key in row and not isinstance(row[key], str) and row[key] is not None:
                    row[key] = json.dumps(row[key])
            rows.append(row)
        self.store.append(
            "episodes",
            [
                {
                    "episode_id": episode_id,
                    "command": command,
                    "cwd": "/work",
                    "started_at": started,
                    "ended_at": None if status == "running" else self.tick(),
                    "exit_code": None if status == "running" else 0,
                    "status": status,
                    "labels": json.dumps(labels),
                    "task_id": task,
                    "round": round,
                    "sample": sample,
                    "split": split,
                }
            ],
        )
        keys = {k for row in rows for k in row}  # Arrow takes a batch's columns from its first row
        self.store.append("turns", [{k: row.get(k) for k in sorted(keys)} for row in rows])
        if reward is not None:
            self.store.append(
                "rewards",
                [
                    {
                        "episode_id": episode_id,
                        "value": reward,
                        "details": json.dumps(details or {"passed": reward > 0}),
                        "source": "verify.py:verify",
                        "created_at": self.tick(),
                    }
                ],
            )
        for flag in flags:
            self.store.append(
                "episode_flags",
                [
                    {
                        "episode_id": episode_id,
                        "flag": flag,
                        "details": json.dumps({"why": flag}),
                        "created_at": self.tick(),
                    }
                ],
            )

    def calc_turns(self, answer: str = ANSWER, *, logprob: float = -0.05) -> list[dict]:
        """A two-call chat episode: a tool call, its result, the final answer; the second prompt extends the first."""
        call = {"id": "call_1", "name": "calc", "arguments": json.dumps({"expression": "12 * 7"})}
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        p1 = self.ids(f"system {SYSTEM} user {QUESTION} assistant ")
        c1 = self.ids('calc {"expression": "12 * 7"}')
        env = self.ids(" tool 84 assistant ")
        c2 = self.ids(answer)
        sent = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": call["arguments"]}}
            ],
        }
        return [
            {
                "request": {"model": "gpt-4o-mini", "messages": messages, "tools": [CALC]},
                "response": {"choices": [{"message": sent, "finish_reason": "tool_calls"}]},
                "tool_calls": [call],
                "finish_reason": "tool_calls",
                "prompt_token_ids": p1,
                "completion_token_ids": c1,
                "completion_logprobs": [logprob * (i + 1) for i in range(len(c1))],
                "prompt_tokens": len(p1),
                "completion_tokens": len(c1),
            },
            {
                "request": {
                    "model": "gpt-4o-mini",
                    "messages": messages + [sent, {"role": "tool", "tool_call_id": "call_1", "content": "84"}],
                    "tools": [CALC],
                },
                "response": {
                    "choices": [{"message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]
                },
                "completion_text": answer,
                "reasoning": "12 times 7 is 84, the tool agrees.",
                "prompt_token_ids": p1 + c1 + env,
                "completion_token_ids": c2,
                "completion_logprobs": [-3.0 if i == 0 else -0.01 for i in range(len(c2))],
                "prompt_tokens": len(p1 + c1 + env),
                "completion_tokens": len(c2),
            },
        ]


def fill_store(store, tokenizer_dir: Path, *, xss: bool = True) -> UiStore:
    """Two rounds of a calculator task (train groups, held-out episodes), one episode per other dialect,
    flags, a running episode, training and loop records; untrusted text carries `XSS` everywhere it can."""
    tok = make_tokenizer(tokenizer_dir)
    b = UiStore(store, tok)
    evil = XSS if xss else "plain"
    store.append(
        "deployments",
        [
            {
                "name": "policy-r1",
                "path": str(tokenizer_dir),
                "base_model": str(tokenizer_dir),
                "kind": "lora",
                "round": 1,
                "created_at": b.tick(),
            }
        ],
    )
    for n, reward in enumerate((1.0, 1.0, 0.0, 0.5)):
        answer = ANSWER if reward == 1.0 else ("The answer is 96." if reward == 0 else "It is about 80.")
        b.episode(
            f"ep-calc-{n}",
            b.calc_turns(answer),
            sample=n,
            reward=reward,
            details={"expected": "84", "got": answer, "note": evil},
        )
    for n in range(2):
        b.episode(f"ep-eval-{n}", b.calc_turns(), split="eval", task="calc-eval", sample=n, reward=0.5 + 0.5 * n)
    for n in range(3):
        b.episode(f"ep-r2-{n}", b.calc_turns(), round=2, sample=n, reward=1.0)
    # Untrusted text in every captured field the UI shows.
    b.episode(
        "ep-xss",
        [
            {
                "request": {
                    "model": evil,
                    "messages": [{"role": "user", "content": evil}],
                    "tools": [{"type": "function", "function": {"name": evil}}],
                },
                "model_requested": evil,
                "model_served": evil,
                "completion_text": evil,
                "reasoning": evil,
                "tool_calls": [{"id": evil, "name": evil, "arguments": json.dumps({"html": evil})}],
                "error": evil,
                "status_code": 500,
                "finish_reason": evil,
                "token_source": None,
            }
        ],
        task=evil,
        sample=0,
        round=1,
        split="train",
        reward=0.25,
        details={"x": evil},
        flags=("verifier_error",),
        command=f"python agent.py --note '{evil}'",
    )
    b.episode(
        "ep-anthropic",
        [
            {
                "dialect": "messages",
                "path": "/v1/messages",
                "host": "api.anthropic.com",
                "token_source": None,
                "model_requested": "claude-sonnet-4-5",
                "request": {
                    "model": "claude-sonnet-4-5",
                    "system": [{"type": "text", "text": "You help with files."}],
                    "messages": [
                        {"role": "user", "content": "List the files."},
                        {
                            "role": "assistant",
                            "content": [
                                {"type": "thinking", "thinking": "I should call ls."},
                                {"type": "tool_use", "id": "tu_1", "name": "ls", "input": {"path": "/srv"}},
                            ],
                        },
                        {
                            "role": "user",
                            "content": [
                                {"type": "tool_result", "tool_use_id": "tu_1", "content": "notes.txt\nplan.md"}
                            ],
                        },
                    ],
                },
                "completion_text": "There are two files: notes.txt and plan.md.",
                "finish_reason": "end_turn",
            }
        ],
        task="files",
        sample=0,
        reward=1.0,
    )
    b.episode(
        "ep-responses",
        [
            {
                "dialect": "responses",
                "path": "/v1/responses",
                "token_source": None,
                "request": {
                    "model": "gpt-4.1-mini",
                    "instructions": "Answer briefly.",
                    "input": [
                        {
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "Weather in Paris?"}],
                        },
                        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Need the weather tool."}]},
                        {
                            "type": "function_call",
                            "name": "get_weather",
                            "call_id": "fc_1",
                            "arguments": '{"city": "Paris"}',
                        },
                        {"type": "function_call_output", "call_id": "fc_1", "output": "18 C, sunny"},
                    ],
                },
                "completion_text": "Paris: 18 C and sunny.",
                "finish_reason": "completed",
            }
        ],
        task="weather",
        sample=0,
        reward=1.0,
    )
    b.episode(
        "ep-completions",
        [
            {
                "dialect": "completions",
                "path": "/v1/completions",
                "request": {"model": "m", "prompt": "Once upon a time"},
                "completion_text": " there was a proxy.",
                "finish_reason": "length",
                "prompt_token_ids": b.ids("Once upon a time"),
                "completion_token_ids": b.ids(" there was a proxy."),
                "completion_logprobs": [-0.2] * len(b.ids(" there was a proxy.")),
            }
        ],
        task="story",
        sample=0,
        reward=0.0,
        flags=("tampered",),
    )
    b.episode("ep-running", [b.calc_turns()[0]], task="calc-1", sample=7, status="running")
    store.append(
        "train_runs",
        [
            {
                "run": "/runs/demo",
                "round": n,
                "started_at": b.tick(),
                "ended_at": b.tick(),
                "base_model": str(tokenizer_dir),
                "kind": "lora",
                "n_samples": 8,
                "n_groups": 2,
                "group_size": 4,
                "mean_reward": 0.6 + 0.1 * n,
                "loss": 0.1,
                "kl": 0.01 * n,
                "is_ratio_mean": 1.0,
                "is_ratio_min": 0.9,
                "is_ratio_max": 1.1,
                "clip_fraction": 0.02 * n,
                "tokens": 400,
                "train_seconds": 1.5,
                "tokens_per_s": 260.0,
                "steps": 2,
                "output": f"/runs/demo/round-{n}/adapter",
                "config": "{}",
            }
            for n in (1, 2)
        ],
    )
    store.append(
        "loop_steps",
        [
            {
                "run": "/runs/demo",
                "round": n,
                "step": step,
                "mean_reward": None,
                "details": json.dumps({"seconds": seconds}),
                "created_at": b.tick(),
            }
            for n in (1, 2)
            for step, seconds in (("collect", 30.0), ("build", 0.2), ("train", 1.1), ("deploy", 0.1), ("eval", 15.0))
        ],
    )
    solver_skipped = {"reason": "no group with a reward spread", "kept": "demo-solver-r1", "seconds": 0}
    refusal = {"promoted": False, "current": "demo-r2", "candidate": "demo-r4", "seconds": 0.1}
    store.append(  # round 3 had nothing to learn: skipped; round 4 trained, but its held-out run refused it
        "loop_steps",
        [
            {
                "run": "/runs/demo",
                "round": n,
                "step": step,
                "mean_reward": None,
                "details": json.dumps(details),
                "created_at": b.tick(),
            }
            for n, step, details in (
                (3, "collect", {"seconds": 30.0}),
                (3, "build", {"seconds": 0.2}),
                (3, "skipped", {"reason": "every group got the same reward (2 of 2)", "kept": "demo-r2", "seconds": 0}),
                (3, "skipped:solver", solver_skipped),
                (4, "collect", {"seconds": 30.0}),
                (4, "train", {"seconds": 1.1}),
                (4, "promote", refusal | {"reason": "held-out reward 0.4 < 0.5 - margin 0"}),
            )
        ],  # either way round 2's deployment stayed
    )
    return b


@pytest.fixture(scope="session")
def ui_db(tmp_path_factory) -> Path:
    """A store with every kind of row the UI shows (fill_store), made once per session."""
    root = tmp_path_factory.mktemp("ui")
    fill_store(Store(root / "ui.duckdb"), root / "tokenizer")
    return root / "ui.duckdb"


# --- a running `lcap ui` -------------------------------------------------------------------------------


class UiServer:
    """`lcap ui` as a user starts it, in a child process; `url` once it answers."""

    def __init__(self, db: Path, *args: str, host: str = "127.0.0.1") -> None:
        self.proc = subprocess.Popen(
            [LCAP, "ui", "--db", str(db), "--host", host, "--port", "0", "--poll", "0.3", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.first_line = self.proc.stdout.readline() if self.proc.stdout else ""
        listening = re.search(r"^lcap ui: http://\S+?:(\d+)/", self.first_line)
        if listening is None:
            self.proc.kill()
            raise RuntimeError(f"lcap ui did not say where it listens: {self.first_line}{self.proc.communicate()[1]}")
        self.port = int(listening.group(1))  # bound by `lcap ui` itself: port 0 is a free one, never raced
        self.url = f"http://{host}:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((host, self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"lcap ui exited: {self.proc.stderr.read() if self.proc.stderr else ''}"
                    ) from None
                time.sleep(0.1)
        raise RuntimeError("lcap ui did not start listening in 30 s")

    def stop(self) -> str:
        """Stop it as Ctrl-C would; everything it printed after its first line."""
        self.proc.send_signal(signal.SIGINT)
        try:
            out, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return out + err


@pytest.fixture(scope="module")
def browser():
    """Headless Debian Chromium driven by Playwright (no browser download: the system one). Closed after the module:
    Playwright's sync API holds an event loop running in the thread, and a worker that runs more tests after the
    browser tests (under xdist) would have every later `asyncio.run` refused."""
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()
