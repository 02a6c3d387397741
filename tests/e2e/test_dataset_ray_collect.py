"""`lcap collect --ray`: episodes as Ray tasks on a real local cluster (`ray start` nodes on this machine, node IP
127.0.0.1), captured by a proxy on each node, their turns stored once by the driver's writer; a node lost mid-run.

The agents are real subprocesses calling a local fake upstream (OpenAI chat calls without the SDK:
tests/stdlib_agent.py) through the node's capture proxy. What an agent sees (its proxy, the node it ran on) goes
to a log named by its task, which the tests read.
Ray's health checks are lowered on the head so that a killed node is seen as dead in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fixtures_capture import SECRET, FakeLLM
from fixtures_ray import closed_port, ray_head, ray_worker
from stdlib_agent import chat_agent

from lcap.store import Store

pytestmark = pytest.mark.slow


LCAP = str(Path(sys.executable).parent / "lcap")


AGENT = chat_agent("""
import json, os, sys, time
task = json.loads(os.environ["LCAP_TASK"])
victim = os.environ.get("LCAP_TEST_VICTIM")
with open(task["log"], "a") as f:
    f.write(json.dumps({"episode": os.environ["LCAP_EPISODE_ID"], "victim": bool(victim), "pid": os.getpid(),
                        "proxy": os.environ["HTTPS_PROXY"].rsplit(":", 1)[1]}) + "\\n")
if task.get("hang"):  # a grandchild too: the whole process group must end on the node
    child = __import__("subprocess").Popen(["sleep", "120"])
    with open(task["hang"], "a") as f:
        f.write(f"{os.getpid()} {child.pid}\\n")
    time.sleep(120)
for i in range(task["calls"]):
    chat([{"role": "user", "content": f"{task['q']} {i}"}], model="m", max_tokens=4)
    if victim and i == 0:
        time.sleep(90)  # its node is lost meanwhile
open("answer.txt", "w").write(open("hint.txt").read() + task["q"])
""")


VERIFIER = """
def judge(ctx):
    return {"reward": float(len((ctx.workdir / "answer.txt").read_text()) % 5), "pid": __import__("os").getpid()}
"""


HEALTH = {  # a lost node is declared dead after a few seconds instead of Ray's default of tens of seconds; a
    # loaded machine's raylet may be slow to answer one check, so it takes five missed in a row
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "5",
}


class _Url:
    url = "http://127.0.0.1:9"  # an upstream never called: the run stops before


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head and one worker node, 1 CPU each; the nodes' lcap home (CA, spools) is their own."""
    tmp = tmp_path_factory.mktemp("ray-collect")
    env = {**HEALTH, "LCAP_HOME": str(tmp / "node-home"), "OPENAI_API_KEY": SECRET}
    with ray_head(tmp / "head.log", num_cpus=1, env=env) as address:
        with ray_worker(address, tmp / "worker.log", num_cpus=1, env=env):
            yield address, env, tmp


@pytest.fixture(scope="module")
def upstream():
    server = FakeLLM()
    server.thread.start()
    yield server
    server.shutdown()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The driver's side: its own lcap home, the agent, the verifier and a template directory."""
    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "driver-home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "judge.py").write_text(VERIFIER)
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "hint.txt").write_text("hint:")
    return tmp_path


def _tasks(project: Path, n: int, calls: int) -> Path:
    log = str(project / "starts.jsonl")
    rows = [{"id": f"t{i}", "q": f"q{i}", "calls": calls, "template": "tpl", "log": log} for i in range(n)]
    path = project / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _argv(project: Path, address: str, upstream: FakeLLM | _Url, *extra: str) -> list[str]:
    return [
        LCAP,
        "collect",
        "--tasks",
        str(project / "tasks.jsonl"),
        "--db",
        str(project / "lcap.duckdb"),
        "--upstream",
        upstream.url,
        "--model",
        "m",
        "--verifier",
        "judge.py:judge",
        "--ray",
        address,
        *extra,
        "--",
        sys.executable,
        str(project / "agent.py"),
    ]


def _starts(project: Path) -> list[dict]:
    path = project / "starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_episodes_run_on_every_node_each_captured_there(cluster, upstream, project):
    address, _, _ = cluster
    _tasks(project, n=4, calls=3)
    result = subprocess.run(
        _argv(project, address, upstream, "-g", "2", "-j", "2"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "8 episodes, 8 ok, 0 failed" in result.stdout

    store = Store(project / "lcap.duckdb")
    rows = store.fetchall("SELECT episode_id, status, reward, reward_source FROM episode_summary")
    assert len(rows) == 8 and {r[1] for r in rows} == {"ok"} and {r[3] for r in rows} == {"judge.py:judge"}
    assert {r[2] for r in rows} == {float(len("hint:q0") % 5)}  # the template reached the node, the verdict came back
    # every call is one turn, stored once, attributed to its episode
    turns = store.fetchall("SELECT episode_id, count(*), count(DISTINCT turn_id) FROM turns GROUP BY episode_id")
    assert sorted(t[1:] for t in turns) == [(3, 3)] * 8 and {t[0] for t in turns} == {r[0] for r in rows}
    assert len(upstream.calls("/chat/completions")) >= 24
    # two nodes, two capture proxies: the agents used the proxy of their own node
    starts = _starts(project)
    assert len(starts) == 8 and len({s["proxy"] for s in starts}) == 2
    # the verifier ran on the nodes, not in the driver
    pids = {json.loads(d[0])["pid"] for d in store.fetchall("SELECT details FROM rewards")}
    assert os.getpid() not in pids

    again = subprocess.run(_argv(project, address, upstream, "-g", "2"), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "8 episodes, 0 ok, 0 failed, 8 skipped (already done)" in again.stdout


def test_a_node_lost_mid_run_loses_nothing(cluster, upstream, project):
    """A third node (1 CPU) runs agents that stop after their first call; the test kills the node once a partial
    turn of one of them is in the store. Its episodes run again elsewhere, without their partial turns; the others
    run once; the store holds exactly tasks x group episodes, each with all its turns once."""
    address, env, tmp = cluster
    _tasks(project, n=4, calls=2)
    victim_env = {**env, "LCAP_TEST_VICTIM": "1"}
    with ray_worker(address, tmp / "victim.log", num_cpus=1, env=victim_env) as victim:
        run = subprocess.Popen(
            _argv(project, address, upstream, "-g", "2", "-j", "3"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        store = Store(project / "lcap.duckdb")
        deadline = time.monotonic() + 240
        lost: list[str] = []
        while not lost:
            assert time.monotonic() < deadline and run.poll() is None, "no episode reached the victim node"
            on_victim = [s["episode"] for s in _starts(project) if s["victim"]]
            if on_victim and (project / "lcap.duckdb").exists():
                stored = store.fetchall(
                    "SELECT DISTINCT episode_id FROM turns WHERE episode_id IN (SELECT unnest(?))", [on_victim]
                )
                lost = [r[0] for r in stored]
            time.sleep(0.3)
        os.killpg(victim.pid, signal.SIGKILL)  # the node and everything Ray ran on it
        for s in _starts(project):  # an agent leads its own process group: on a real node it dies with the machine
            if s["victim"]:
                try:
                    os.killpg(s["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert "8 episodes, 8 ok, 0 failed" in out
    assert "lost" in err and lost[0] in err

    rows = store.fetchall("SELECT episode_id, status FROM episodes")
    assert len(rows) == 8 and {r[1] for r in rows} == {"ok"}
    turns = store.fetchall("SELECT episode_id, count(*), count(DISTINCT turn_id) FROM turns GROUP BY episode_id")
    assert sorted(t[1:] for t in turns) == [(2, 2)] * 8  # the lost attempt's partial turn is gone
    runs = Counter(s["episode"] for s in _starts(project))
    victims = {s["episode"] for s in _starts(project) if s["victim"]}
    assert set(lost) <= victims
    assert all(runs[e] == 2 for e in victims) and all(runs[e] == 1 for e in runs if e not in victims)
    assert sorted(runs) == sorted(r[0] for r in rows)


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare (a mount namespace)"
)
def test_the_policy_key_reaches_nodes_that_cannot_read_the_drivers_key_file(cluster, project, tmp_path, monkeypatch):
    """`collect --ray --upstream policy` with replicas behind a key (`serve --ray`): the record names the key's file
    on the driver's machine, which a node on another host lacks. Here the driver runs in a mount namespace of its
    own, where the file is on a tmpfs that the nodes (outside it) never see; the key travels in the nodes' actor
    arguments, goes upstream on every call, and is written to no file on the nodes or in the store."""
    from fixtures_capture import store_text

    address, _, tmp = cluster
    key = "policy-key-" + os.urandom(16).hex()
    secret = tmp_path / "driver-only"
    secret.mkdir()
    replica = _policy_replica(
        tmp_path,
        monkeypatch,
        ["tiny"],
        on_ray={"actor": "lcap-replica-x-r0", "node": "127.0.0.1"},
        ray_address=address,
        api_key_file=str(secret / "policy.key"),
    )
    _tasks(project, n=2, calls=2)
    argv = _argv(project, address, _Url(), "-g", "1")
    argv[argv.index("--upstream") + 1] = "policy"
    del argv[argv.index("--model") : argv.index("--model") + 2]
    driver = (
        f'mount -t tmpfs -o mode=0700 lcap-test {secret} && printf %s "$POLICY_KEY" > {secret}/policy.key && exec "$@"'
    )
    try:
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", driver, "sh", *argv],
            env={**os.environ, "POLICY_KEY": key},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        replica.shutdown()
    assert not (secret / "policy.key").exists()  # only the driver's namespace had it
    assert result.returncode == 0, result.stderr
    assert "2 episodes, 2 ok, 0 failed" in result.stdout
    calls = replica.calls("/chat/completions")
    assert len(calls) == 4 and all(c["headers"]["authorization"] == f"Bearer {key}" for c in calls)
    rows = Store(project / "lcap.duckdb").fetchall("SELECT replica, status_code FROM turns")
    assert rows == [("r0", 200)] * 4
    assert key not in store_text(project / "lcap.duckdb")
    node_files = [p for p in (tmp / "node-home").rglob("*") if p.is_file()]
    assert node_files and not [p for p in node_files if key.encode() in p.read_bytes()]


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for its reaper."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.2)
    return False


def _hanging(project: Path, n: int) -> Path:
    hang = project / "hang.txt"
    rows = [
        {"id": f"h{i}", "q": "q", "calls": 1, "log": str(project / "starts.jsonl"), "hang": str(hang)} for i in range(n)
    ]
    (project / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return hang


def test_timeouts_and_ctrl_c_end_the_agents_on_their_nodes(cluster, upstream, project):
    address, _, _ = cluster
    hang = _hanging(project, 2)
    result = subprocess.run(
        _argv(project, address, upstream, "-g", "1", "--timeout", "8"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stderr  # no episode finished ok
    assert "2 episodes, 0 ok, 2 timeout" in result.stdout and "timeout 2" in result.stdout
    pids = [int(p) for line in hang.read_text().splitlines() for p in line.split()]
    assert len(pids) == 4 and all(_dead(p) for p in pids)  # agents and their grandchildren

    hang.unlink()
    run = subprocess.Popen(
        _argv(project, address, upstream, "-g", "1", "--round", "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not hang.exists() or len(hang.read_text().splitlines()) < 2:
        assert time.monotonic() < deadline and run.poll() is None, run.stderr.read() if run.stderr else ""
        time.sleep(0.3)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    pids = [int(p) for line in hang.read_text().splitlines() for p in line.split()]
    assert all(_dead(p) for p in pids)
    rows = Store(project / "lcap.duckdb").fetchall("SELECT status FROM episodes WHERE round = 1")
    assert [r[0] for r in rows] == ["interrupted", "interrupted"]


def test_bad_cluster_and_options_are_one_line(project):
    _tasks(project, n=1, calls=1)
    with closed_port() as port:
        result = subprocess.run(
            _argv(project, f"127.0.0.1:{port}", _Url()), capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 2 and result.stderr.startswith(f"lcap: no Ray cluster at 127.0.0.1:{port}")
    assert len(result.stderr.strip().splitlines()) == 1

    bad = subprocess.run(
        _argv(project, "auto", _Url(), "--episode-resources", "sandbox"), capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "bad --episode-resources 'sandbox': use NAME=AMOUNT" in bad.stderr
    local = [a for a in _argv(project, "x", _Url(), "--episode-cpus", "2") if a not in ("--ray", "x")]
    alone = subprocess.run(local, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "add --ray ADDRESS" in alone.stderr


def test_a_cluster_no_node_fits_is_one_line(cluster, upstream, project):
    address, _, _ = cluster
    _tasks(project, n=1, calls=1)
    result = subprocess.run(
        _argv(project, address, upstream, "--episode-resources", "sandbox=1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"no node of the Ray cluster at {address} can run an episode, which needs CPU=1, sandbox=1" in result.stderr


def _driver_of(project: Path, address: str) -> tuple[Store, list[str]]:
    """This process as the driver of collects on the cluster at `address`: two tasks of two calls, the project's
    store and its agent's command."""
    import ray

    from lcap.ray_cluster import connect

    _tasks(project, n=2, calls=2)
    if ray.is_initialized():
        ray.shutdown()
    connect(address)
    return Store(project / "lcap.duckdb"), [sys.executable, str(project / "agent.py")]


def _collect_once(
    store: Store, project: Path, command: list[str], address: str, upstream, *, group_size: int = 2, **kw
):
    """The project's tasks x `group_size`, two at a time, on the cluster, to the `upstream` (a test's fake LLM)."""
    from lcap.dataset.collect.episodes import collect_episodes
    from lcap.dataset.options import CollectOptions

    options = CollectOptions(
        group_size=group_size, concurrency=2, round=1, upstream=upstream.url, model="m", ray=address
    )
    return collect_episodes(
        store, tasks=project / "tasks.jsonl", command=command, options=options, progress=False, **kw
    )


def _policy_replica(
    tmp_path: Path, monkeypatch, deployments: list[str], *, on_ray: dict[str, str] | None = None, **record: Any
) -> FakeLLM:
    """A policy record naming one replica (a fake vLLM that serves `deployments`), as `lcap serve` writes it;
    `on_ray`: the replica's Ray actor and node; `record`: more of the record's fields."""
    from lcap.policy import PolicyServer, Replica, write_policy

    replica = FakeLLM(vllm=True)
    replica.models = deployments
    replica.thread.start()
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    write_policy(
        PolicyServer(
            url=replica.url,
            pid=None,
            base_model="tiny",
            served_model=deployments[0],
            current=deployments[0],
            log_path="",
            python="",
            started_at="2026-01-01T00:00:00+00:00",
            replicas=[Replica(name="r0", url=replica.url, **(on_ray or {}))],
            **record,
        )
    )
    return replica


def test_a_loops_collects_share_the_node_proxies_and_each_sees_the_last_deploy(cluster, project, tmp_path, monkeypatch):
    """The node proxies of `lcap loop --ray`: started once per node for all the loop's collects, each collect's
    turns attributed to its own episodes and round, a deploy between two collects reaching the running proxies
    (round 2 is served by round 1's deployment), and every proxy actor gone once the loop ends."""
    import ray

    from lcap.dataset.collect.episodes import collect_episodes
    from lcap.dataset.collect.on_ray import NodeProxies
    from lcap.dataset.options import CollectOptions
    from lcap.policy import read_policy, write_policy

    address, _, _ = cluster
    replica = _policy_replica(tmp_path, monkeypatch, ["tiny", "tiny-r1"])
    store, command = _driver_of(project, address)
    try:
        with NodeProxies(store) as proxies:
            known = []
            for n in (1, 2):
                options = CollectOptions(group_size=2, concurrency=2, round=n, verifier="judge.py:judge", ray=address)
                result = collect_episodes(
                    store,
                    tasks=project / "tasks.jsonl",
                    command=command,
                    options=options,
                    progress=False,
                    node_proxies=proxies,
                )
                assert (result.finished, result.failed) == (4, 0)
                known.append(proxies.known())
                if n == 1:  # what `lcap deploy` does once the replica loaded round 1's adapter
                    record = read_policy()
                    record.current = "tiny-r1"
                    write_policy(record)
            assert proxies.starts == 1 and len(known[0]) == 2 and known[1].keys() == known[0].keys()
        for handle in known[0].values():  # the loop's end stopped them
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(handle.ready.remote(), timeout=60)
    finally:
        ray.shutdown()
        replica.shutdown()

    # Two nodes, two proxies (a proxy per node and collect would listen on new ports in round 2).
    assert len({s["proxy"] for s in _starts(project)}) <= 2 and len(_starts(project)) == 8
    served = store.fetchall(
        "SELECT e.round, list(DISTINCT t.deployment), count(*), count(DISTINCT t.turn_id), count(DISTINCT episode_id) "
        "FROM turns t JOIN episodes e USING (episode_id) GROUP BY e.round ORDER BY e.round"
    )
    assert served == [(1, ["tiny"], 8, 8, 4), (2, ["tiny-r1"], 8, 8, 4)]
    asked = [c["body"]["model"] for c in replica.calls("/chat/completions")]
    assert asked == ["tiny"] * 8 + ["tiny-r1"] * 8


def _node_proxies_running(node_home: str) -> list[int]:
    """The pids of this cluster's node proxy actors (Ray titles an actor's process `ray::CLASS`)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes()
            if (
                title.startswith(b"ray::NodeProxy")
                and f"LCAP_HOME={node_home}".encode() in (proc / "environ").read_bytes()
            ):
                pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return pids


def test_ctrl_c_on_a_ray_loop_leaves_no_node_proxy_nor_agent(cluster, project, tmp_path, monkeypatch):
    address, env, _ = cluster
    replica = _policy_replica(tmp_path, monkeypatch, ["tiny"])
    hang = _hanging(project, 2)
    argv = [LCAP, "loop", "--db", str(project / "lcap.duckdb"), "--run", str(project / "run"), "--rounds", "2"]
    argv += ["--tasks", str(project / "tasks.jsonl"), "-g", "1", "--ray", address, "--"]
    argv += [sys.executable, str(project / "agent.py")]
    try:
        run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not hang.exists() or len(hang.read_text().splitlines()) < 2:
            assert time.monotonic() < deadline and run.poll() is None, run.stderr.read() if run.stderr else ""
            time.sleep(0.3)
        running = _node_proxies_running(env["LCAP_HOME"])
        assert running
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=120)
    finally:
        replica.shutdown()
    assert run.returncode == 130, err
    pids = [int(p) for line in hang.read_text().splitlines() for p in line.split()]
    assert all(_dead(p) for p in pids + running)
    assert not _node_proxies_running(env["LCAP_HOME"])
    rows = Store(project / "lcap.duckdb").fetchall("SELECT status FROM episodes WHERE round = 1")
    assert [r[0] for r in rows] == ["interrupted", "interrupted"]


def test_kept_node_proxies_replace_a_lost_one_and_start_on_a_node_that_joins(cluster, upstream, project, caplog):
    """Between two collects of one `NodeProxies` (a loop's), one node's proxy dies and a node joins: the next collect
    runs on a new proxy on the first node (its workers' cached handle of the dead one costs no episode a rerun) and
    starts one on the new node, keeps the other one, and stores every episode's turns once."""
    import ray

    from lcap.dataset.collect.episodes import collect_episodes
    from lcap.dataset.collect.on_ray import NodeProxies
    from lcap.dataset.options import CollectOptions

    address, env, tmp = cluster
    store, command = _driver_of(project, address)

    def run(proxies: NodeProxies, n: int) -> dict:
        options = CollectOptions(group_size=2, concurrency=3, round=n, upstream=upstream.url, model="m", ray=address)
        result = collect_episodes(
            store, tasks=project / "tasks.jsonl", command=command, options=options, progress=False, node_proxies=proxies
        )
        assert (result.finished, result.failed) == (4, 0)
        return proxies.known()

    try:
        with NodeProxies(store) as proxies:
            first = run(proxies, 1)
            gone_key, gone = next(iter(first.items()))
            ray.kill(gone, no_restart=True)
            deadline = time.monotonic() + 60
            while gone_key in proxies.known():  # the ingest saw it die
                assert time.monotonic() < deadline
                time.sleep(0.2)
            with ray_worker(address, tmp / "joins.log", num_cpus=1, env=env):
                second = run(proxies, 2)
                assert proxies.starts == 1
                proxies.close()  # before the node that joined leaves
    finally:
        ray.shutdown()
    assert len(first) == 2 and gone_key not in second and len(second) == 3
    kept = set(first) - {gone_key}
    assert kept <= set(second)
    nodes = {key.split("#")[0] for key in second}
    assert len(nodes) == 3 and gone_key.split("#")[0] in nodes  # a new proxy on the node whose proxy died
    turns = store.fetchall("SELECT episode_id, count(*), count(DISTINCT turn_id) FROM turns GROUP BY episode_id")
    assert sorted(t[1:] for t in turns) == [(2, 2)] * 8
    assert "running it again" not in caplog.text  # no episode was lost with the dead proxy


def test_a_nodes_episodes_start_before_another_nodes_proxy_is_ready(cluster, upstream, project, monkeypatch):
    """The worker node's proxy is held before its start until an agent ran: the head's episodes do not wait for it
    (each episode waits for its own node's proxy only), then the held one starts and the run ends with every turn."""
    import threading

    import ray

    from lcap.dataset.collect import node_proxies as ray_collect

    address, _, _ = cluster
    store, command = _driver_of(project, address)
    head = ray.get_runtime_context().get_node_id()
    held: dict[str, float] = {}

    def start_proxy(config, node_id):
        if node_id == head:
            return original(config, node_id)
        handle = ray_collect._NodeProxyActor.options(
            num_cpus=0,
            max_concurrency=config.max_concurrency,
            scheduling_strategy=ray_collect.NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(config)

        def release() -> None:
            deadline = time.monotonic() + 60  # then started anyway: the assertions below fail instead of a hang
            while not _starts(project) and time.monotonic() < deadline:
                time.sleep(0.1)
            held["agents_before"] = len(_starts(project))
            handle.start.remote()

        threading.Thread(target=release, daemon=True).start()
        return handle

    original = ray_collect._start_proxy
    monkeypatch.setattr(ray_collect, "_start_proxy", start_proxy)
    try:
        result = _collect_once(store, project, command, address, upstream)
    finally:
        ray.shutdown()
    assert (result.finished, result.failed) == (4, 0)
    assert held["agents_before"] >= 1  # an agent ran while the other node's proxy had not started
    assert len({s["proxy"] for s in _starts(project)}) == 2  # and the held node ran episodes once it started
    turns = store.fetchall("SELECT count(*), count(DISTINCT turn_id) FROM turns")
    assert turns == [(8, 8)]


def test_fewer_episodes_than_nodes_start_proxies_only_where_they_run(cluster, upstream, project):
    """One episode on a two-node cluster: one node proxy is started, on the node the episode is then sent to, before
    the episode is sent (not once it landed), and the episode runs behind it."""
    import ray

    from lcap.dataset.collect.on_ray import NodeProxies

    address, _, _ = cluster
    store, command = _driver_of(project, address)
    _tasks(project, n=1, calls=2)
    try:
        with NodeProxies(store) as proxies:
            result = _collect_once(store, project, command, address, upstream, group_size=1, node_proxies=proxies)
            known = proxies.known()
            started = ray.get(proxies.started[0], timeout=60)  # by the driver, before the episode was sent
    finally:
        ray.shutdown()
    assert (result.finished, result.failed) == (1, 0)
    assert len(known) == 1 and {key.split("#")[0] for key in known} == set(started)
    assert store.fetchall("SELECT count(*) FROM turns") == [(2,)]


def test_an_episode_on_a_node_without_a_proxy_comes_back_and_runs_there(
    cluster, upstream, project, monkeypatch, caplog
):
    """No proxy started before the episodes (as on nodes that join mid-run): each node's first episode comes back
    unrun, the driver starts that node's proxy and sends the episode back there; none counts as lost, one proxy per
    node, every turn stored once."""
    import ray

    from lcap.dataset.collect import on_ray as ray_collect
    from lcap.dataset.collect.on_ray import NodeProxies

    address, _, _ = cluster
    store, command = _driver_of(project, address)
    original = NodeProxies._start
    monkeypatch.setattr(NodeProxies, "_start", lambda self, config, nodes: original(self, config, []))
    moved = []
    original_move = ray_collect._Run._move

    def move(self, attempt, report, queue, ended):
        moved.append(report.node_id)
        original_move(self, attempt, report, queue, ended)

    monkeypatch.setattr(ray_collect._Run, "_move", move)
    try:
        with NodeProxies(store) as proxies:
            result = _collect_once(store, project, command, address, upstream, node_proxies=proxies)
            known = proxies.known()
    finally:
        ray.shutdown()
    assert (result.finished, result.failed) == (4, 0)
    assert moved and len(known) == len({key.split("#")[0] for key in known}) <= 2
    assert set(moved) <= {key.split("#")[0] for key in known}
    assert store.fetchall("SELECT count(*), count(DISTINCT turn_id) FROM turns") == [(8, 8)]
    assert "running it again" not in caplog.text
