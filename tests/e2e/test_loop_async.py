"""`lcap loop --async` on the real vLLM CPU server: steps on complete groups while episodes stay in flight, the
staleness bound, an episode spanning a deploy, a LoRA deploy under streaming calls, and a kill and resume."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from openai import APIError, OpenAI
from stdlib_agent import chat_agent

from lcap.dataset.options import BuildOptions, CollectOptions
from lcap.loop.options import LoopOptions
from lcap.loop.rounds import run_loop
from lcap.loop.steps import LoopConfig, LoopState, continued
from lcap.policy import read_policy
from lcap.store import Store
from lcap.train.options import TrainOptions

REPO = Path(__file__).resolve().parents[2]


# An unmodified agent (an OpenAI chat call without the SDK: tests/stdlib_agent.py): one call, then (for a task with
# "hold") it waits for that file before it ends, like an agent in a long tool call; a space ends its answer, so
# completions finish with "stop".
AGENT = chat_agent("""
import json, os, sys, time
from pathlib import Path
reply = chat([{"role": "user", "content": sys.argv[1]}], max_tokens=12, temperature=1.0, stop=[" "])
hold = json.loads(os.environ["LCAP_TASK"]).get("hold")
deadline = time.monotonic() + 300
while hold and not Path(hold).exists() and time.monotonic() < deadline:
    time.sleep(0.1)
print(reply)
""")


# Rewards with variance in every group: the share of lowercase letters, plus a step per sample index.
VERIFIER = """
def verify(ctx):
    said = ctx.stdout.strip()
    return 0.8 * sum(c.islower() for c in said) / max(len(said), 1) + 0.1 * ctx.sample
"""


# Two calls, the second extending the first (the bias on the end-of-turn token, argv[2], makes the model end its
# turn at once: its completion re-renders to the same tokens); with argv[3], it says so between the two calls
# and waits for that file.
TWO_CALLS = """
import sys, time
from pathlib import Path
from openai import OpenAI
client, messages = OpenAI(), [{"role": "user", "content": sys.argv[1]}]
for call in range(2):
    if call and len(sys.argv) > 3:
        Path(sys.argv[3] + ".called").touch()
        deadline = time.monotonic() + 300
        while not Path(sys.argv[3]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    reply = client.chat.completions.create(model="gpt-4o-mini", max_tokens=8, messages=messages,
                                           logit_bias={sys.argv[2]: 100})
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": "Go on."}]
print("done")
"""


def _write(tmp_path: Path, tasks: list[dict]) -> Path:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "verify.py").write_text(VERIFIER)
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def _batches(state: dict) -> dict[int, list[str]]:
    return {int(k.split(":")[0]): v["groups"] for k, v in state["steps"].items() if k.endswith(":batch")}


@pytest.mark.vllm
def test_async_loop_steps_on_complete_groups_and_drops_stale_samples(vllm_policy, openai_env, tmp_path, monkeypatch):
    """One group per step, --max-staleness 1. The `slow` group's episodes call the base policy and then stay in
    flight until step 2 has taken its batch: steps 1 and 2 train the groups that finished first, and the slow
    group, served two versions before the policy step 3 trains, is dropped (counted) and step 3 takes the next."""
    monkeypatch.chdir(tmp_path)
    release = tmp_path / "release"
    tasks = _write(
        tmp_path,
        [{"id": "slow", "q": "Which is a number: code seven tool", "hold": str(release)}]
        + [{"id": f"t{i}", "q": f"Which is a number: {w} list text"} for i, w in enumerate(["one", "two", "six"])],
    )
    run = tmp_path / "run"
    config = LoopConfig(
        run=run,
        rounds=3,
        tasks=tasks,
        command=[sys.executable, str(tmp_path / "agent.py"), "{q}"],
        collect=CollectOptions(group_size=2, concurrency=4, timeout=300, verifier=f"{tmp_path / 'verify.py'}:verify"),
        train=TrainOptions(learning_rate=1e-3, report_to="none"),
        build=BuildOptions(truncated="keep"),  # a rare answer cut by max_tokens would leave its group short
        options=LoopOptions(overlap=True, max_staleness=1, groups_per_step=1),
    )

    def release_after_step_2_batch(stop: threading.Event) -> None:
        while not stop.is_set():
            state = run / "state.json"
            if state.exists() and "2:batch" in json.loads(state.read_text())["steps"]:
                release.touch()
                return
            time.sleep(0.1)

    stop = threading.Event()
    watcher = threading.Thread(target=release_after_step_2_batch, args=(stop,), daemon=True)
    watcher.start()
    lines: list[str] = []
    try:
        summaries = run_loop(Store(tmp_path / "lcap.duckdb"), config, echo=lines.append)
    finally:
        stop.set()
    assert [s.round for s in summaries] == [1, 2, 3], lines
    state = json.loads((run / "state.json").read_text())
    batches = _batches(state)
    assert "1/train/slow" not in batches[1] + batches[2]  # still in flight: the steps took the groups done first
    assert state["void"] == ["1/train/slow"] and state["steps"]["3:void"]["staleness"] == {"2": 2}
    taken = [g for groups in batches.values() for g in groups]
    assert len(taken) == len(set(taken)) == 3 and "1/train/slow" not in taken

    store = Store(tmp_path / "lcap.duckdb")
    rows = store.fetchall(
        "SELECT step, groups, queue, samples, dropped_stale, staleness, trainer_wait_s, agent_wait_s, deployed "
        "FROM async_steps ORDER BY step"
    )
    assert [r[0] for r in rows] == [1, 2, 3] and all(r[1] == 1 and r[2] >= 1 for r in rows)
    assert [r[4] for r in rows] == [0, 0, 2]  # the slow group's two samples, two versions behind: dropped
    assert json.loads(rows[2][5]) == {"0": 2, "2": 2}  # the trained group's own two, fresh; the dropped two
    assert all(r[6] >= 0 and r[7] >= 0 for r in rows)
    assert lines[2].startswith("step 3: every sample of 1 groups was stale")
    assert "staleness 0:2 2:2, dropped 2" in lines[3]
    deployed = [r[8] for r in rows]
    assert [r[0] for r in store.fetchall("SELECT round FROM train_runs ORDER BY round")] == [1, 2, 3]
    assert [d for (d,) in store.fetchall("SELECT name FROM deployments WHERE kind = 'lora' ORDER BY round")] == deployed
    # Each step trained exactly its batch, on samples of the deployment it started from.
    for n, groups in batches.items():
        data = pq.read_table(run / f"round-{n}" / "data" / "samples.parquet").to_pylist()
        assert {s["group_id"] for s in data} == set(groups)
        assert {s["deployment"] for s in data} == {vllm_policy.served_model if n == 1 else deployed[n - 2]}
    # The slow episodes ran through two deploys, served by the base policy.
    slow = store.fetchall(
        "SELECT DISTINCT t.deployment FROM turns t JOIN episode_summary e USING (episode_id) "
        "WHERE e.group_id = '1/train/slow'"
    )
    assert slow == [(vllm_policy.served_model,)]

    # Each step's move is measured after training; resumed with a --max-step-kl every step exceeds, step 4 trains
    # and is refused: recorded as such, never deployed, and the next step would train from step 3's adapter.
    assert store.fetchall("SELECT count(*) FROM train_runs WHERE step_kl > 0") == [(3,)]
    strict = replace(config, rounds=4, options=replace(config.options, max_step_kl=1e-12))
    (fourth,) = run_loop(store, strict, echo=lines.append)
    assert fourth.round == 4 and fourth.refused.startswith("training moved the policy by KL")
    assert (
        lines[-1].startswith("step 4: refused: training moved the policy by KL")
        and f"; {deployed[2]} stays" in lines[-1]
    )
    state = LoopState(run, strict.key())
    assert state.done(4, "promote")["promoted"] is False and state.done(4, "deploy") is None
    assert continued(state, 5) == Path(state.done(3, "train")["output"])
    assert read_policy().current == deployed[2] and store.fetchall(
        "SELECT count(*) FROM deployments WHERE round = 4"
    ) == [(0,)]


@pytest.mark.vllm
def test_an_episode_spanning_a_deploy_keeps_each_turns_deployment(
    vllm_policy, tiny_lora, openai_env, tmp_path, monkeypatch
):
    """Call 2 extends call 1 and merges with it into one sample, unless a deploy came between them: then each
    call keeps the deployment that served it, and the merge splits there and marks the second sample."""
    from transformers import AutoTokenizer

    from lcap.dataset.build.builder import build_dataset
    from lcap.dataset.collect.episodes import collect_episodes
    from lcap.serve.deploy import deploy_policy

    monkeypatch.chdir(tmp_path)
    end = AutoTokenizer.from_pretrained(vllm_policy.model_dir).convert_tokens_to_ids("<|im_end|>")
    (tmp_path / "two_calls.py").write_text(TWO_CALLS)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "q", "q": "Name a file."}) + "\n")
    (tmp_path / "verify.py").write_text(VERIFIER)
    store = Store(tmp_path / "lcap.duckdb")
    verifier = f"{tmp_path / 'verify.py'}:verify"
    options = CollectOptions(group_size=1, concurrency=1, timeout=300, upstream="policy", verifier=verifier)
    go = tmp_path / "go"
    agent = [sys.executable, str(tmp_path / "two_calls.py"), "{q}", str(end)]

    # round 0: no deploy between
    collect_episodes(store, tasks=tmp_path / "tasks.jsonl", command=agent, options=options)
    spanning = threading.Thread(
        target=collect_episodes,
        args=(store,),
        kwargs=dict(tasks=tmp_path / "tasks.jsonl", command=[*agent, str(go)], options=replace(options, round=1)),
    )
    spanning.start()
    deadline = time.monotonic() + 120
    while not Path(f"{go}.called").exists():
        assert time.monotonic() < deadline and spanning.is_alive()
        time.sleep(0.1)
    name = deploy_policy(tiny_lora, round=1, store=store)
    time.sleep(3)  # the proxy re-reads the policy record (capture/routing/routes.py REFRESH_S)
    go.touch()
    spanning.join(300)

    base = vllm_policy.served_model
    turns = store.fetchall(
        "SELECT e.round, t.deployment FROM turns t JOIN episodes e USING (episode_id) ORDER BY 1, seq"
    )
    assert turns == [(0, base), (0, base), (1, base), (1, name)]
    for round, parts in ((0, [(2, False, base)]), (1, [(1, False, base), (1, True, name)])):
        # one episode per group: zero variance kept so that its samples are written
        options = BuildOptions(keep_zero_variance=True, truncated="keep")
        report = build_dataset(store, round=round, out=tmp_path / f"d{round}", options=options)
        samples = pq.read_table(tmp_path / f"d{round}" / "samples.parquet").to_pylist()
        assert [(s["n_turns"], s["deployment"]) for s in samples] == [(n, d) for n, _, d in parts]
        assert report.sample_counts["split_at_deploy"] == sum(mark for _, mark, _ in parts)


@pytest.mark.vllm
def test_a_lora_deploy_drops_no_streaming_call(vllm_policy, tiny_lora, tmp_path):
    """Streaming calls through the proxy keep going while an adapter is hot-loaded: none fails, the ones in flight
    finish on the policy they started on, and calls after the switch ask for the adapter."""
    from lcap.capture.options import ProxyOptions
    from lcap.capture.proxy.server import CaptureProxy
    from lcap.serve.deploy import deploy_policy

    calls: list[dict] = []
    stop = threading.Event()

    def agent(proxy: CaptureProxy, worker: int) -> None:
        env = proxy.child_env(f"stream-{worker}", base={})
        verify = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
        with httpx.Client(proxy=env["HTTPS_PROXY"], verify=verify, timeout=300) as http:
            client = OpenAI(api_key="sk-test", http_client=http, max_retries=0)
            while not stop.is_set():
                call = {"started": time.monotonic()}
                try:
                    chunks = list(
                        client.chat.completions.create(
                            model="gpt-4o-mini",
                            messages=[{"role": "user", "content": "Count from one to ten."}],
                            max_tokens=24,
                            stream=True,
                        )
                    )
                    call.update(ok=True, model=chunks[0].model, chunks=len(chunks))
                except APIError as exc:
                    call.update(ok=False, error=str(exc))
                call["ended"] = time.monotonic()
                calls.append(call)

    with CaptureProxy(Store(tmp_path / "lcap.duckdb"), ProxyOptions(upstream="policy")) as proxy:
        workers = [threading.Thread(target=agent, args=(proxy, w), daemon=True) for w in range(3)]
        for w in workers:
            w.start()
        while len(calls) < 6:
            time.sleep(0.1)
        name = deploy_policy(tiny_lora, round=1, store=Store(tmp_path / "lcap.duckdb"))
        done = time.monotonic()
        while not any(c["started"] > done + 3 for c in calls):
            time.sleep(0.1)
        stop.set()
        for w in workers:
            w.join(120)
    assert calls and all(c["ok"] for c in calls), [c for c in calls if not c["ok"]][:3]
    assert {c["model"] for c in calls} == {"tiny", name}
    assert all(c["model"] == name for c in calls if c["started"] > done + 3)
    assert all(c["chunks"] > 1 for c in calls)


@pytest.mark.vllm
@pytest.mark.slow
def test_async_loop_killed_and_resumed_loses_and_retrains_no_group(vllm_policy, tmp_path):
    """SIGKILL `lcap loop --async` once step 2 has taken its batch (episodes in flight), run the same command
    again: step 2 trains that same batch, every step trains once, and no group is in two batches."""
    tasks = _write(
        tmp_path,
        [{"id": f"t{i}", "q": f"Which is a number: {w} code tool"} for i, w in enumerate(["one", "two", "six"])],
    )
    db, run = tmp_path / "lcap.duckdb", tmp_path / "run"
    lcap = REPO / ".venv" / "bin" / "lcap"
    command = [str(lcap) if lcap.exists() else "lcap", "loop", "--async", "--max-staleness", "1"]
    command += ["--groups-per-step", "1", "--db", str(db), "--run", str(run), "--rounds", "3", "--tasks", str(tasks)]
    command += ["--group-size", "2", "--concurrency", "4", "--verifier", f"{tmp_path / 'verify.py'}:verify"]
    command += ["--truncated", "keep"]  # a rare answer cut by max_tokens would leave its group short
    (tmp_path / "eval.jsonl").write_text(json.dumps({"id": "e0", "q": "Which is a number: list five text"}) + "\n")
    command += ["--eval-tasks", str(tmp_path / "eval.jsonl"), "--eval-group-size", "2"]
    command += ["--lr", "1e-3", "--report-to", "none", "--", sys.executable, str(tmp_path / "agent.py"), "{q}"]
    env = dict(os.environ, OPENAI_API_KEY="sk-test")
    state = run / "state.json"

    first = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        if state.exists() and "2:batch" in json.loads(state.read_text())["steps"]:
            break
        time.sleep(0.1)
    assert first.poll() is None, first.stdout.read().decode()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    before = json.loads(state.read_text())
    assert "2:train" not in before["steps"]

    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "step 2: 1 groups" in second.stdout and "step 3: held-out reward" in second.stdout
    after = json.loads(state.read_text())
    batches = _batches(after)
    assert batches[2] == _batches(before)[2]  # the batch taken before the kill, trained after it
    taken = [g for groups in batches.values() for g in groups]
    assert len(taken) == len(set(taken)) == 3
    store = Store(db)
    counts = dict(store.fetchall("SELECT round || ':' || step, count(*) FROM loop_steps GROUP BY ALL"))
    assert counts["1:batch"] == counts["2:batch"] == counts["3:batch"] == 1
    assert all(counts[f"{n}:eval"] == 1 for n in (0, 1, 2, 3))  # held-out runs beside the next step's training
    # Each step's held-out episodes were all served by that step's deployment.
    served = store.fetchall(
        "SELECT e.round, list(DISTINCT t.deployment) FROM turns t JOIN episodes e USING (episode_id) "
        "WHERE e.split = 'eval' GROUP BY ALL ORDER BY 1"
    )
    names = [after["steps"][f"{n}:deploy"]["name"] for n in (1, 2, 3)]
    assert served == [(0, [vllm_policy.served_model])] + [(n, [names[n - 1]]) for n in (1, 2, 3)]
    assert store.fetchall("SELECT round, count(*) FROM train_runs GROUP BY ALL ORDER BY 1") == [(1, 1), (2, 1), (3, 1)]
    for n, groups in batches.items():
        data = pq.read_table(run / f"round-{n}" / "data" / "samples.parquet").to_pylist()
        assert {s["group_id"] for s in data} == set(groups)
    # The episodes the kill cut short were run again: every episode of a trained group finished.
    statuses = store.fetchall(
        "SELECT DISTINCT status FROM episode_summary WHERE group_id IN (SELECT unnest(?::VARCHAR[]))", [taken]
    )
    assert statuses == [("ok",)]
