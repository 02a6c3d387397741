"""Two real vLLM CPU replicas of the tiny model (`lcap serve --replicas 2`) behind the capture proxy.

One module-scoped pair of servers (each ~1-2 GB, ~30 s to start) serves every test here, in file order:
status, stickiness and spread, a LoRA deploy while agents run, a rolling full-checkpoint deploy while
agents run, the kill of one replica mid-run (it is not brought back), and last a restart of the survivor
alone while agents run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fixtures_capture import turns
from policy_agents import Agents, policy_proxy

from lcap.policy import PolicyServer, read_policy, write_policy
from lcap.store import Store

pytestmark = pytest.mark.vllm

LCAP = str(Path(sys.executable).parent / "lcap")
# Seconds between an agent's episodes in the tests that restart a replica: calls all along, and the CPU left to
# the restart (it takes a vLLM start, which agents calling flat out slow down for every test of the run).
PAUSE = 0.5


@dataclass
class Pair:
    home: Path
    model_dir: Path
    db: Path  # the store `lcap serve` recorded the base deployment in

    @property
    def record(self) -> PolicyServer:
        record = read_policy()
        assert record is not None
        return record


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    from lcap.config import LcapError
    from lcap.serve.server import stop_server
    from lcap.serve.vllm_process import resolve_python

    try:
        python = resolve_python()
    except LcapError as exc:
        pytest.skip(f"vLLM cannot be installed or imported here: {exc}")
    home = tmp_path_factory.mktemp("replicas-home")
    venv = Path(python).parent.parent
    if venv.name == "vllm-venv":
        (home / "vllm-venv").symlink_to(venv, target_is_directory=True)
    saved = {key: os.environ.get(key) for key in ("LCAP_HOME", "LCAP_POLICY_RECORD")}
    os.environ["LCAP_HOME"] = str(home)
    os.environ["LCAP_POLICY_RECORD"] = str(home / "policy.json")
    try:
        db = home / "serve.duckdb"
        started = subprocess.run(
            [LCAP, "serve", "-m", str(tiny_model_dir), "--name", "tiny", "--replicas", "2", "--timeout", "900"]
            + ["--db", str(db)],
            capture_output=True,
            text=True,
            timeout=1000,
        )
        assert started.returncode == 0, f"lcap serve failed:\n{started.stdout}\n{started.stderr[-4000:]}"
        assert "policy server ready: 2 replicas serving 'tiny'" in started.stdout
        yield Pair(home, tiny_model_dir, db)
    finally:
        if read_policy() is not None:
            stop_server()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_serve_status_lists_both_replicas(pair):
    status = subprocess.run([LCAP, "serve", "--status"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["running"] and state["replicas_healthy"] == 2
    replicas = state["replicas"]
    assert [r["name"] for r in replicas] == ["r0", "r1"] and len({r["url"] for r in replicas}) == 2
    assert all(r["alive"] and r["healthy"] and r["in_flight"] == 0 for r in replicas)
    assert all("--enable-lora" in Path(r["log_path"]).read_text() for r in replicas)
    rows = Store(pair.db).fetchall("SELECT name, kind FROM deployments")
    assert rows == [("tiny", "base")]


def test_episodes_stick_to_a_replica_and_spread_over_both(pair, tmp_path):
    with policy_proxy(tmp_path) as proxy, Agents(proxy, threads=2) as agents:
        agents.wait_for(32)
        agents.stop.set()
    assert all(c["ok"] for c in agents.calls), [c for c in agents.calls if not c["ok"]][:3]
    rows = turns(tmp_path / "lcap.duckdb")
    by_episode: dict[str, set[str]] = {}
    for row in rows:
        by_episode.setdefault(row["episode_id"], set()).add(row["replica"])
        assert row["token_source"] == "vllm" and row["deployment"] == "tiny"
        assert row["upstream"] == pair.record.replica(row["replica"]).url
    assert all(len(served) == 1 for served in by_episode.values())  # sticky
    assert set().union(*by_episode.values()) == {"r0", "r1"}  # spread


def test_a_lora_deploy_reaches_both_replicas_before_any_call_asks_for_it(pair, tiny_lora, tmp_path):
    """Agents keep calling while the adapter is deployed: every call is answered (vLLM answers 404 for a model
    it does not serve), and from the switch on both replicas serve the adapter."""
    from lcap.serve.deploy import deploy_policy

    with policy_proxy(tmp_path) as proxy, Agents(proxy, threads=4) as agents:
        agents.wait_for(8)
        name = deploy_policy(tiny_lora, round=1, store=Store(pair.db))
        switched = time.monotonic()
        agents.wait_for(24)
        agents.wait_after(switched + 1)
    assert read_policy().current == name
    failed = [c for c in agents.calls if not c["ok"]]
    assert not failed, failed[:3]
    assert {c["model"] for c in agents.calls} == {"tiny", name}
    rows = turns(tmp_path / "lcap.duckdb")
    on_lora = {r["replica"] for r in rows if r["deployment"] == name}
    assert on_lora == {"r0", "r1"}, on_lora
    assert all(r["model_served"] == r["deployment"] and r["status_code"] == 200 for r in rows)
    assert any(c["started"] > switched + 1 and c["model"] == name for c in agents.calls)


def test_a_full_checkpoint_reloads_into_one_replica_at_a_time(pair, tmp_path):
    """A checkpoint with other weights and the same config while agents run: each replica in turn pauses, reloads
    in place and serves the new deployment (under the name vLLM started with) while the other still serves the
    old one; no call fails, no server restarts, and every turn's deployment is the one its replica served then."""
    from fixtures_vllm import perturbed_checkpoint, watching_record

    from lcap.serve.deploy import deploy_policy

    record = pair.record
    record.current = record.served_model  # off the LoRA of the test before: a LoRA current means a restart
    write_policy(record)
    before = pair.record
    checkpoint = perturbed_checkpoint(pair.model_dir, tmp_path / "round-1" / "checkpoint")
    try:
        with policy_proxy(tmp_path) as proxy, Agents(proxy, threads=4, stream_every=2, max_tokens=16) as agents:
            agents.wait_for(8)
            with watching_record(lambda record: tuple(r.serving(record) for r in record.replicas)) as states:
                name = deploy_policy(checkpoint, name="tiny-r1", round=1, store=Store(pair.db), drain_timeout=120)
            agents.wait_for(8)
        after = pair.record
        assert after.current == name and after.served_name(name) == before.served_model
        assert [r.pid for r in after.replicas] == [r.pid for r in before.replicas]  # nothing restarted
        failed = [c for c in agents.calls if not c["ok"]]
        assert not failed, failed[:3]
        seen = [s for _, s in states]
        old = before.current
        assert (name, old) in seen and (old, name) not in seen  # r0 first, then r1; never r1 alone
        switched = {i: min(t for t, s in states if s[i] == name) for i in range(2)}
        rows = turns(tmp_path / "lcap.duckdb")
        assert {r["deployment"] for r in rows} == {old, name} and all(r["status_code"] == 200 for r in rows)
        for row in rows:  # a turn that ended before its replica switched was served by the old weights, else new
            index = int(row["replica"][1:])
            assert row["deployment"] == (name if row["ended_at"].timestamp() > switched[index] else old), row
    finally:  # the tests that follow expect the tiny model's own weights under its own name
        deploy_policy(pair.model_dir, name=before.current)


@pytest.mark.slow
def test_a_full_checkpoint_rolls_one_replica_at_a_time(pair, tmp_path):
    """A full checkpoint restart (`--restart`; also what a changed config gets) while agents run: one replica at a
    time drains (its episodes go to the other), restarts on the checkpoint and comes back; no call fails, calls in
    flight at the drain finish, and once done every call asks for the new deployment."""
    from fixtures_vllm import watching_record

    from lcap.serve.deploy import deploy_policy

    before = pair.record
    checkpoint = tmp_path / "round-2" / "checkpoint"
    shutil.copytree(pair.model_dir, checkpoint)
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):  # weights only: the tokenizer is the base's
        (checkpoint / tokenizer_file).unlink(missing_ok=True)

    def replica_states(record: PolicyServer) -> tuple:
        return tuple((r.name, r.draining, r.current) for r in record.replicas)

    with policy_proxy(tmp_path) as proxy, Agents(proxy, threads=4, max_tokens=24, pause=PAUSE) as agents:
        agents.wait_for(8)
        with watching_record(replica_states, every=0.05) as states:
            name = deploy_policy(
                checkpoint, name="tiny-v2", round=2, store=Store(pair.db), drain_timeout=120, restart=True
            )
            done = time.monotonic()
        agents.wait_for(16)
        agents.wait_after(done + 1)
    after = pair.record
    assert name == "tiny-v2" and after.current == after.served_model == "tiny-v2"
    assert after.base_model == str(checkpoint.resolve()) and "--tokenizer" in after.vllm_args
    assert [r.url for r in after.replicas] == [r.url for r in before.replicas]
    assert all(a.pid != b.pid for a, b in zip(after.replicas, before.replicas, strict=True))
    assert not any(r.draining or r.current for r in after.replicas)
    failed = [c for c in agents.calls if not c["ok"]]
    assert not failed, failed[:3]
    # One at a time: never were both replicas draining; each was, in turn; in between r0 served the new one.
    seen = [s for _, s in states]
    assert not any(all(draining for _, draining, _ in s) for s in seen)
    assert any(s[0][1] for s in seen) and any(s[1][1] for s in seen)
    assert (("r0", False, "tiny-v2"), ("r1", True, None)) in seen
    assert {c["model"] for c in agents.calls if c["started"] > done + 1} == {"tiny-v2"}
    rows = turns(tmp_path / "lcap.duckdb")
    assert {r["deployment"] for r in rows} == {before.current, "tiny-v2"} and all(r["status_code"] == 200 for r in rows)


@pytest.mark.slow
def test_a_killed_replica_moves_its_episodes_to_the_other(pair, tmp_path):
    """SIGKILL one replica's process group while agents run. A call that had no answer yet is sent again to the
    other replica (the agent does not see the kill); a stream already under way is cut, and that call fails.
    Every call that starts after the kill is answered, by the survivor.

    The kill waits until the victim has answered calls of this test: the agents' episode ids are fixed, and the
    first four (eight calls) all rank r1 first, so a count of calls alone may pass before r0 answered any."""
    victim = pair.record.replica("r0")
    served_before = _answered(victim.url)
    with (
        policy_proxy(tmp_path) as proxy,
        Agents(proxy, threads=4, stream_every=3, max_tokens=24, pause=PAUSE) as agents,
    ):
        agents.wait_for(12)
        deadline = time.monotonic() + 300
        while _answered(victim.url) < served_before + 2:
            assert time.monotonic() < deadline, "r0 answered no call of this test"
            time.sleep(0.1)
        killed, killed_at = time.monotonic(), time.time()
        os.killpg(victim.pid, signal.SIGKILL)
        agents.wait_for(24)
    failed = [c for c in agents.calls if not c["ok"]]
    assert all(c["stream"] and c["started"] < killed for c in failed), failed  # only streams under way at the kill
    late = [c for c in agents.calls if c["started"] > killed]
    assert late and all(c["ok"] for c in late)
    rows = turns(tmp_path / "lcap.duckdb")
    after = [r for r in rows if r["started_at"].timestamp() > killed_at + 0.5]
    assert after and {r["replica"] for r in after} == {"r1"}
    assert {r["replica"] for r in rows} == {"r0", "r1"}


def _answered(url: str) -> int:
    """Requests the vLLM server at `url` has finished, from its Prometheus metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total{")
        )
    )


@pytest.mark.slow
def test_a_lone_replica_restarting_holds_calls_instead_of_failing_them(pair, tmp_path):
    """One replica left (r0 is killed if the test before did not): a `--restart` deploy while agents run drains it
    and restarts it; the proxy holds the calls sent meanwhile, and they are answered after the restart by the new
    deployment, which their turns store. No call fails."""
    from fixtures_vllm import watching_record

    from lcap.serve.deploy import deploy_policy

    record = pair.record
    try:
        os.killpg(record.replica("r0").pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    record.replicas = [record.replica("r1")]
    write_policy(record)
    old = record.current
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(pair.model_dir, checkpoint)

    with (
        policy_proxy(tmp_path) as proxy,
        Agents(proxy, threads=3, stream_every=2, max_tokens=16, pause=PAUSE) as agents,
    ):
        agents.wait_for(6)
        with watching_record(lambda record: record.replicas[0].draining, every=0.05) as states:
            name = deploy_policy(checkpoint, name="tiny-held", store=Store(pair.db), drain_timeout=120, restart=True)
        agents.wait_for(6)
    after = pair.record
    assert after.current == after.served_model == name and after.replicas[0].pid != record.replicas[0].pid
    failed = [c for c in agents.calls if not c["ok"]]
    assert not failed, failed[:3]
    drained = min(t for t, draining in states if draining)
    back = max(t for t, draining in states if draining)  # the record's last look before the replica rejoined
    rows = turns(tmp_path / "lcap.duckdb")
    held = [r for r in rows if r["started_at"].timestamp() < back < r["ended_at"].timestamp()]
    assert held, "no call was sent while the replica restarted: the test did not exercise the hold"
    assert all(r["deployment"] == name for r in held), held
    # Every call sent once the proxies had read the mark (their refresh, REFRESH_S, and a margin) was held.
    assert all(r in held for r in rows if drained + 1 < r["started_at"].timestamp() < back)
    assert {r["deployment"] for r in rows} == {old, name} and all(r["status_code"] == 200 for r in rows)
