"""Live traffic end to end (issue #37 requirement 6): many sessions through one serving proxy while `lcap loop
--live` trains and promotes twice on held-out evidence, and a forced rollback moves the policy back; then every
check from the store.

    .venv/bin/python benchmarks/sim_live_traffic.py [--out sim-live] [--sessions 500] [--agents 8]
        [--min-samples 64] [--seed 0]

The task is `lcap demo`'s number task (loop/demo/number.py: "Which is a number: code seven tool" -> "Answer:
seven"), its tiny model warm-started as the demo does, on one vLLM CPU server (`lcap serve`), behind one `lcap proxy
--serve --upstream policy`. `--agents` threads call it with no per-episode set-up: each session asks one training
question the way the demo's agent does (scripts/demo/agent.py), under an `X-Lcap-Session` header, and every second
session asks it again in the same conversation. A session's reward is the demo verifier's score of its last answer
(scripts/demo/verify.py: 1 right, 0.5 well-formed, else 0), due 1 s to 10 min after it (times --delay-scale, 1 by
default), and POSTERS threads post each to the proxy's reward endpoint when it is due: late, in an order the random
delays shuffle (the last up to 10 min after the agents stop). One session in ten gets a second post of its key with
another value (200, not stored), and one in twenty a post for a session that never ran (404).

The live loop runs two steps with the demo's training settings and a batch baseline (`--advantage batch`: no
question repeats), --max-staleness (0: a step trains on sessions the current deployment served) and
--promote-margin (the loop's default, 0: a candidate is promoted only when its held-out reward is no worse than
the current deployment's), each candidate and deployment evaluated on the demo's 64 held-out questions x
--eval-group-size. Once it is done, `lcap deploy --rollback --round 1` restores the first promotion while the
agents keep calling. Checks, from the store: no failed call, every call stored in its session's episode (the sim
counts each session's calls), every reward stored once on its session's episode with the value of the post
answered 201, as many 200s as duplicates and 404s as unknown sessions, the deployments rows (two promotions, one
rollback), which deployment served the calls after the rollback, and how late the rewards came (`reward_delays`).
Reported beside them: the reward posts' latency and the held-out mean reward (`loop_steps`) of the base before the
loop, of the last promoted candidate and of the one rolled back to. Prints one JSON object; exits 1 when a check
fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

from lcap.loop.demo import number
from lcap.loop.demo.number import write_jsonl
from lcap.loop.demo.runner import MODEL
from lcap.loop.demo.task import demo_dir, load_script, words
from lcap.serve.tiny_model import init_model
from lcap.serve.vllm_process import resolve_python
from lcap.store import Store

LCAP = str(Path(sys.executable).parent / "lcap")
KEY = "sk-sim-tenant-0123456789"
POSTERS = 4
VERIFY = load_script(demo_dir() / "verify.py", "demo_verify")


class Sim:
    def __init__(
        self, proxy: str, rewards_url: str, tasks: list[dict], sessions: int, seed: int, delay_scale: float
    ) -> None:
        self.proxy, self.rewards_url, self.tasks, self.sessions = proxy, rewards_url, tasks, sessions
        self.delay_scale = delay_scale
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.next = 0
        self.calls: list[dict] = []  # session, seq, started, model
        self.failures: list[str] = []
        self.pending: list[dict] = []  # rewards not posted yet
        self.posted: dict[int, int] = {}  # HTTP status -> posts
        self.post_errors: list[str] = []
        self.post_s: list[float] = []  # posts that got no answer (timed out), each posted again
        self.done_agents = threading.Event()
        self.values: dict[str, float] = {}  # session -> the value of the post answered 201 (stored)
        self.duplicates = 0  # second posts of a key
        self.ghosts = 0  # posts for sessions that never ran
        self.calls_of: dict[str, int] = {}  # session -> calls answered
        self.enough = threading.Event()

    def take(self) -> int | None:
        """The next session's number; past --sessions, sessions go on until `enough` (the rollback has been seen)."""
        with self.lock:
            if self.next >= self.sessions and self.enough.is_set():
                return None
            self.next += 1
            return self.next - 1

    def agent(self, pace: float) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(proxy=self.proxy, timeout=600) as client:
            while (i := self.take()) is not None:
                session = f"sim-{i}"
                task = self.tasks[i % len(self.tasks)]
                said = ""
                messages = [{"role": "user", "content": task["question"]}]
                for seq in range(1 + i % 2):
                    body = {"model": "gpt-4o-mini", "messages": messages, "max_tokens": 8, "temperature": 1.0}
                    started = time.monotonic()
                    try:
                        answer = client.post(
                            "http://api.openai.com/v1/chat/completions",
                            json=body,
                            headers={**headers, "X-Lcap-Session": session},
                        )
                        answer.raise_for_status()
                        reply = answer.json()
                    except Exception as exc:
                        with self.lock:
                            self.failures.append(f"{session}/{seq}: {exc!r}")
                        break
                    with self.lock:
                        self.calls.append({"session": session, "seq": seq, "started": started, "model": reply["model"]})
                        self.calls_of[session] = self.calls_of.get(session, 0) + 1
                    said = reply["choices"][0]["message"]["content"] or ""
                    messages = [*messages, {"role": "assistant", "content": said}, messages[0]]
                with self.lock:
                    if session not in self.calls_of:
                        continue
                    due = time.monotonic() + self.rng.uniform(1, 600) * self.delay_scale
                    value = VERIFY.score(task["answer"], said)["reward"]
                    self.pending.append({"due": due, "session": session, "value": value, "key": session})
                    if self.rng.random() < 0.1:  # posted twice, with another value: the later one is not stored
                        self.duplicates += 1
                        later = time.monotonic() + self.rng.uniform(1, 600) * self.delay_scale
                        self.pending.append(
                            {"due": max(due, later), "session": session, "value": value + 1, "key": session}
                        )
                    if self.rng.random() < 0.05:  # a session that never ran
                        self.ghosts += 1
                        self.pending.append({"due": due, "session": f"ghost-{i}", "value": 1.0, "key": f"ghost-{i}"})
                time.sleep(pace)

    def rewarder(self) -> None:
        """Posts each reward once it is due: late, in an order that is not the sessions' (random delays)."""
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=300) as client:
            while True:
                with self.lock:
                    if self.done_agents.is_set() and not self.pending:
                        return
                    now = time.monotonic()
                    due = [p for p in self.pending if p["due"] <= now]
                    post = min(due, key=lambda p: p["due"]) if due else None
                    if post is not None:
                        self.pending.remove(post)
                if post is None:
                    time.sleep(0.05)
                    continue
                body = {k: post[k] for k in ("session", "value", "key")}
                t = time.monotonic()
                try:
                    answer = client.post(self.rewards_url, json={**body, "source": "sim"}, headers=headers)
                except httpx.HTTPError as exc:  # posted again later: its key makes a retry safe
                    with self.lock:
                        self.post_errors.append(repr(exc))
                        self.pending.append(post)
                    continue
                with self.lock:
                    self.posted[answer.status_code] = self.posted.get(answer.status_code, 0) + 1
                    if answer.status_code == 201:
                        self.values[post["session"]] = post["value"]
                    self.post_s.append(time.monotonic() - t)

    def models_after(self, since: float) -> dict[str, int]:
        with self.lock:
            out: dict[str, int] = {}
            for call in self.calls:
                if call["started"] > since:
                    out[call["model"]] = out.get(call["model"], 0) + 1
            return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("sim-live"))
    ap.add_argument("--sessions", type=int, default=500)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--min-samples", type=int, default=64)
    ap.add_argument("--pace", type=float, default=0.2, help="seconds an agent waits between two sessions")
    ap.add_argument("--delay-scale", type=float, default=1.0, help="times each reward's delay (1 s to 10 min)")
    ap.add_argument("--promote-margin", type=float, default=0.0, help="the live loop's; 10 forces both promotions")
    ap.add_argument("--max-staleness", type=int, default=0, help="the live loop's")
    ap.add_argument("--eval-group-size", type=int, default=1, help="episodes per held-out question")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = resolve_python()
    home = out / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_BASE_URL", "NO_PROXY", "no_proxy")}
    env.update(LCAP_HOME=str(home), LCAP_POLICY_RECORD=str(home / "policy.json"), LCAP_DB=str(out / "lcap.duckdb"))
    env.update(OPENAI_API_KEY="sk-eval-not-a-real-key", PYTHONUNBUFFERED="1")
    os.environ.update(LCAP_HOME=env["LCAP_HOME"], LCAP_POLICY_RECORD=env["LCAP_POLICY_RECORD"])
    settings = number.TASK.settings(args.seed)
    train, held_out = number.make_tasks(words(), n_train=4000, n_eval=settings.n_eval, seed=args.seed)
    eval_tasks = write_jsonl(out / "heldout.jsonl", held_out)
    model = out / "model"
    if not (model / "warm_start.json").exists():
        init_model(model, replace(MODEL, seed=args.seed))
        (model / "warm_start.json").write_text(json.dumps(number.TASK.warm_start(model, settings)))
    t0 = time.monotonic()
    subprocess.run([LCAP, "serve", "--model", str(model), "--name", "base", "--python", python], env=env, check=True)
    proxy_log = (out / "proxy.log").open("w")  # its warnings (a row not stored yet, ...) for reading afterwards
    proxy = subprocess.Popen(
        [LCAP, "proxy", "--serve", "--upstream", "policy"], env=env, stdout=subprocess.PIPE, stderr=proxy_log, text=True
    )
    report: dict = {"agents": args.agents, "serve_s": round(time.monotonic() - t0, 1)}
    try:
        line = proxy.stdout.readline()
        port = int(line.split("listening on http://127.0.0.1:", 1)[1].split()[0])
        record = json.loads((home / "proxies" / f"{port}.json").read_text())
        sim = Sim(f"http://127.0.0.1:{port}", record["rewards_url"], train, args.sessions, args.seed, args.delay_scale)
        agents = [threading.Thread(target=sim.agent, args=(args.pace,), daemon=True) for _ in range(args.agents)]
        rewarders = [threading.Thread(target=sim.rewarder, daemon=True) for _ in range(POSTERS)]
        started = time.monotonic()
        for thread in [*agents, *rewarders]:
            thread.start()
        loop = subprocess.run(
            [LCAP, "loop", "--live", "--run", str(out / "run"), "--rounds", "2", "--min-samples", str(args.min_samples)]
            + ["--max-staleness", str(args.max_staleness), "--promote-margin", str(args.promote_margin)]
            + ["--wait-timeout", "900", "--eval-tasks", str(eval_tasks), "--eval-group-size", str(args.eval_group_size)]
            + ["--verifier", f"{demo_dir() / 'verify.py'}:verify", "--advantage", "batch", "--truncated", "keep"]
            + ["--lr", str(settings.lr), "--epochs", str(settings.epochs), "--epsilon-high", str(settings.epsilon_high)]
            + ["--batch-size", str(settings.batch_size), "--report-to", "none", "--", *number.agent_command()],
            env=env,
            capture_output=True,
            text=True,
        )
        report["loop_lines"] = [line for line in loop.stdout.splitlines() if line.startswith("step ")]
        report["loop_rc"] = loop.returncode
        loop_done = time.monotonic()
        back = subprocess.run([LCAP, "deploy", "--rollback", "--round", "1"], env=env, capture_output=True, text=True)
        report["rollback"] = (back.stdout or back.stderr).strip()
        rolled = time.monotonic()
        deadline = rolled + 300
        while len(sim.models_after(rolled + 1.0)) == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5)
        sim.enough.set()
        for thread in agents:
            thread.join()
        sim.done_agents.set()
        for thread in rewarders:
            thread.join()
        report["traffic_s"] = round(time.monotonic() - started, 1)
        report["sessions"] = sessions = sim.next
        report["calls"] = len(sim.calls)
        report["failed_calls"] = len(sim.failures)
        report["reward_posts"] = {str(k): v for k, v in sorted(sim.posted.items())}
        report["reward_post_retries"] = len(sim.post_errors)
        report["duplicates_posted"], report["ghosts_posted"] = sim.duplicates, sim.ghosts
        took = sorted(sim.post_s)
        report["reward_post_s"] = (
            {
                "p50": round(took[len(took) // 2], 3),
                "p90": round(took[int(0.9 * len(took))], 3),
                "max": round(took[-1], 3),
            }
            if took
            else {}
        )
        report["answered_by_after_loop"] = sim.models_after(loop_done + 1.0)
        report["answered_by_after_rollback"] = sim.models_after(rolled + 1.0)
    finally:
        proxy.send_signal(signal.SIGINT)
        proxy.wait(120)
        proxy_log.close()
        subprocess.run([LCAP, "serve", "--stop"], env=env, capture_output=True)

    store = Store(out / "lcap.duckdb")
    one = lambda sql: store.fetchall(sql)[0]  # noqa: E731
    report["store"] = {
        "sessions": one("SELECT count(*) FROM episodes WHERE labels->>'session' LIKE 'sim-%'")[0],
        "turns": one(
            "SELECT count(*) FROM turns t JOIN episodes e USING (episode_id) WHERE e.labels->>'session' LIKE 'sim-%'"
        )[0],
        "failed_turns": one("SELECT count(*) FROM turns WHERE error IS NOT NULL OR status_code >= 400")[0],
        "rewards": one("SELECT count(*), count(DISTINCT episode_id) FROM rewards WHERE source = 'sim'"),
        "deployments": store.fetchall("SELECT name, kind, round, rollback_of FROM deployments ORDER BY created_at"),
        "trained_per_step": store.fetchall(
            "SELECT round, count(*) FROM episodes WHERE split = 'live' GROUP BY 1 ORDER BY 1"
        ),
        "late_s": [
            round(x, 2)
            for x in one("SELECT min(late_s), median(late_s), max(late_s) FROM reward_delays WHERE source = 'sim'")
        ],
    }
    stored_calls = dict(
        store.fetchall(
            "SELECT e.labels->>'session', count(t.turn_id) FROM episodes e LEFT JOIN turns t USING (episode_id) "
            "WHERE e.labels->>'session' LIKE 'sim-%' GROUP BY 1"
        )
    )
    stored_values = dict(
        store.fetchall(
            "SELECT e.labels->>'session', r.value FROM rewards r JOIN episodes e USING (episode_id) WHERE r.source = 'sim'"
        )
    )
    report["store"]["calls_in_the_right_session"] = sum(stored_calls.get(k) == v for k, v in sim.calls_of.items())
    report["store"]["rewards_with_the_posted_value"] = sum(stored_values.get(k) == v for k, v in sim.values.items())
    steps = store.fetchall("SELECT round, step, mean_reward, details FROM loop_steps ORDER BY created_at")
    before = [r[2] for r in steps if r[1] == "eval-current" and r[0] == 1]
    promoted = [json.loads(r[3]) for r in steps if r[1] == "promote"]
    after = [p["candidate_reward"] for p in promoted if p.get("promoted")]
    first = [p["candidate_reward"] for p in promoted[:1] if p.get("promoted")]
    report["held_out"] = {
        "before (base, step 1 eval-current)": before[0] if before else None,
        "after the loop (last promoted candidate)": after[-1] if after else None,
        "after the rollback (step 1's candidate)": first[0] if first else None,
        "promotions": [
            {
                k: p.get(k)
                for k in ("candidate", "candidate_reward", "current", "current_reward", "margin", "promoted", "reason")
            }
            for p in promoted
        ],
    }
    s = report["store"]
    lora = [d for d in s["deployments"] if d[1] == "lora" and d[3] is None]
    rollbacks = [d for d in s["deployments"] if d[3] is not None]
    checks = {
        "no failed call": report["failed_calls"] == 0 and s["failed_turns"] == 0,
        "at least --sessions sessions": sessions >= args.sessions,
        "every session stored": s["sessions"] == sessions,
        "every call stored": s["turns"] == report["calls"],
        "every call in its session's episode": s["calls_in_the_right_session"] == len(sim.calls_of),
        "every reward on its session's episode, the stored post's value": s["rewards_with_the_posted_value"]
        == len(sim.values),
        "every reward once": s["rewards"][0] == s["rewards"][1] == sessions,
        "duplicates 200, ghosts 404, rest 201": set(report["reward_posts"]) <= {"200", "201", "404"}
        and report["reward_posts"].get("200", 0) == sim.duplicates
        and report["reward_posts"].get("404", 0) == sim.ghosts
        and report["reward_posts"].get("201") == sessions,
        "two promotions": len(lora) == 2,
        "one rollback to step 1's": len(rollbacks) == 1 and bool(lora) and rollbacks[0][0] == lora[0][0],
        "calls after the rollback served by it": bool(lora)
        and set(report["answered_by_after_rollback"]) == {lora[0][0]},
    }
    report["checks"] = checks
    print(json.dumps(report, indent=2, default=str))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
