"""Routing to policy replicas (capture/routing/routes.py): sticky and consistent by episode, failover, health, the key.

The replicas here are FakeLLM servers answering like vLLM, each in a process of its own so that a test
can kill one the way a replica dies (every connection reset at once). The same routing against two
real vLLM servers is in tests/e2e/test_serve_replicas.py.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import textwrap
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from fixtures_capture import FakeLLM, turns, wait_until
from websockets.exceptions import InvalidStatus

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.capture.routing.routes import Router
from lcap.capture.status import proxies
from lcap.policy import PolicyServer, Replica, write_policy
from lcap.status import View
from lcap.store import Store

TESTS = Path(__file__).resolve().parents[1]


CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


SERVER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, %r)
    from fixtures_capture import FakeLLM
    server = FakeLLM(vllm=True)
    server.models = json.loads(sys.argv[1])
    if sys.argv[2] != "-":
        server.fail = (int(sys.argv[2]), {"error": {"message": "engine dead"}})
    print(server.server_address[1], flush=True)
    server.serve_forever()
""") % str(TESTS)


class Replicas:
    """FakeLLM replicas as processes; `log` reads the requests each got (by the key it was started with)."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}

    def start(self, name: str, models: list[str], fail: int | None = None) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, json.dumps(models), str(fail) if fail else "-"],
            stdout=subprocess.PIPE,
            text=True,
        )
        port = int(proc.stdout.readline())
        self.procs[name], self.urls[name] = proc, f"http://127.0.0.1:{port}"
        return self.urls[name]

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def replicas():
    made = Replicas()
    yield made
    made.close()


@pytest.fixture
def fake_replicas(record_env):
    """Two FakeLLM replicas in this process (r0, r1), serving 'tiny', recorded as the policy."""
    servers = [FakeLLM(vllm=True), FakeLLM(vllm=True)]
    for server in servers:
        server.models = ["tiny"]
        server.thread.start()
    _record({"r0": servers[0].url, "r1": servers[1].url})
    yield servers
    for server in servers:
        server.shutdown()


def _record(urls: dict[str, str], current: str = "tiny", **extra) -> PolicyServer:
    record = PolicyServer(
        url="",
        pid=None,
        base_model="tiny",
        served_model="tiny",
        current=current,
        log_path="",
        python="",
        started_at=datetime.now(UTC).isoformat(),
        replicas=[Replica(name=name, url=url) for name, url in urls.items()],
        **extra,
    )
    write_policy(record)
    return record


def _client(proxy: CaptureProxy, episode: str | None) -> httpx.Client:
    env = proxy.child_env(episode, base={})
    return httpx.Client(
        proxy=env["HTTPS_PROXY"], verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"]), timeout=30
    )


def _chat(proxy: CaptureProxy, episode: str, **extra) -> httpx.Response:
    with _client(proxy, episode) as client:
        return client.post("https://api.openai.com/v1/chat/completions", json={**CHAT, **extra})


def test_a_reloaded_deployment_is_asked_for_by_its_served_name_and_settles_calls_that_end_after_it(record_env):
    """A full checkpoint reloaded in place (serve/deploy.py): the record maps the new deployment to the name vLLM
    kept serving; routes ask vLLM for that name and carry the deployment. A call labelled with the old deployment
    when it was sent that ends once its replica serves the new one under the same name was served by the new
    weights (the pause held it); under another name (a LoRA, a restart) its label stands."""
    urls = {"r0": "http://127.0.0.1:9", "r1": "http://127.0.0.1:10"}
    record = _record(urls, loras={"lora-a": "/adapters/a"})
    router = Router("policy", None, health_interval=3600)
    try:
        assert router.settle("r0", "tiny") == "tiny" and router.settle("r0", "lora-a") == "lora-a"
        record.replicas[0].current = "tiny-r1"  # r0 reloaded, r1 not yet
        record.served_as = {"tiny-r1": "tiny"}
        write_policy(record)
        time.sleep(0.6)
        router.route("episode")  # re-reads the record
        routes = {r.replica: (r.model, r.deployment) for r in router.routes()}
        assert routes == {"r0": ("tiny", "tiny-r1"), "r1": ("tiny", "tiny")}
        assert router.settle("r0", "tiny") == "tiny-r1"  # held by r0's pause, served by the new weights
        assert router.settle("r1", "tiny") == "tiny"  # r1 has not reloaded
        assert router.settle("r0", "lora-a") == "lora-a"  # another name: the adapter served it before the pause
        assert router.settle(None, "tiny") == "tiny"

        record.replicas[0].current = None  # a restart on a new name: nothing is relabelled
        record.served_model = record.current = "tiny-v2"
        write_policy(record)
        time.sleep(0.6)
        assert router.settle("r0", "tiny-r1") == "tiny-r1" and router.settle("r1", "tiny") == "tiny"
        assert {(r.model, r.deployment) for r in router.routes()} == {("tiny-v2", "tiny-v2")}
    finally:
        router.close()


def test_a_record_rewritten_within_one_clock_tick_is_read_again(record_env):
    """Two writes of the record can share a modification time (the clock's tick is coarser than a deploy's steps):
    the router still sees the second, a new file."""
    from lcap.policy import record_path

    record = _record({"r0": "http://127.0.0.1:9", "r1": "http://127.0.0.1:10"})
    router = Router("policy", None, health_interval=3600)
    try:
        assert {router.route(f"e{i}").replica for i in range(20)} == {"r0", "r1"}
        before = os.stat(record_path())
        record.replicas[1].draining = True
        write_policy(record)
        os.utime(record_path(), ns=(before.st_atime_ns, before.st_mtime_ns))
        time.sleep(0.6)
        assert {router.route(f"e{i}").replica for i in range(20)} == {"r0"}  # the first re-reads the record
    finally:
        router.close()


def test_episodes_stick_to_one_replica_spread_and_move_only_when_theirs_leaves(record_env):
    urls = {f"r{i}": f"http://127.0.0.1:{9 + i}" for i in range(4)}  # nothing listens: no call is made here
    record = _record(urls)
    router = Router("policy", None, health_interval=3600)
    try:
        episodes = [f"episode-{i}" for i in range(400)]
        first = {e: router.route(e).replica for e in episodes}
        assert all(router.route(e).replica == first[e] for e in episodes[:50])  # sticky
        counts = Counter(first.values())
        assert set(counts) == set(urls) and min(counts.values()) > 60, counts  # spread (100 each on average)
        assert {router.route(None).replica for _ in range(8)} == set(urls)  # no episode: round robin

        # A replica that fails leaves: only its episodes move, each to its second choice; the others stay.
        router.failed("r1", "test")
        moved = {e: router.route(e).replica for e in episodes}
        assert all(moved[e] == first[e] for e in episodes if first[e] != "r1")
        assert {moved[e] for e in episodes if first[e] == "r1"} == {"r0", "r2", "r3"}
        assert router.route("x", frozenset({"r0", "r2", "r3"})).replica == "r1"  # last resort: a replica that is out
        assert router.route("x", frozenset(urls)) is None

        # Draining (a full checkpoint replaces it) is read from the record; the same consistency holds.
        record.replicas[2].draining = True
        write_policy(record)
        time.sleep(0.6)
        drained = {e: router.route(e).replica for e in episodes}
        assert all(drained[e] == moved[e] for e in episodes if moved[e] != "r2")
        assert "r2" not in drained.values()
        assert router.out_of_rotation() == {"r1"}
    finally:
        router.close()

    # The hash is stable across processes (not Python's salted hash): another process routes the same way.
    code = (
        "import json,sys; from lcap.capture.routing.routes import Router; r = Router('policy', None, health_interval=3600); "
        "print(json.dumps({e: r.route(e).replica for e in json.loads(sys.argv[1])})); r.close()"
    )
    record.replicas[2].draining = False
    write_policy(record)
    other = subprocess.run(
        [sys.executable, "-c", code, json.dumps(episodes)], capture_output=True, text=True, env=os.environ, timeout=60
    )
    assert json.loads(other.stdout) == first, other.stderr


def test_a_killed_replica_moves_its_episodes_and_no_call_fails(tmp_path, record_env, replicas):
    """Each episode's calls go to one replica; a killed replica's episodes go on with the other, every call
    answered (the failed connection is retried there); each turn stores the replica that served it."""
    _record({"r0": replicas.start("r0", ["tiny"]), "r1": replicas.start("r1", ["tiny"])})
    db = tmp_path / "lcap.duckdb"
    episodes = [f"ep-{i}" for i in range(12)]
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        for episode in episodes:
            for stream in (False, True):
                assert _chat(proxy, episode, stream=stream).status_code == 200
        assert proxy.flush(timeout=10)
        before = {r["episode_id"]: r["replica"] for r in turns(db)}
        assert set(before.values()) == {"r0", "r1"}  # spread
        replicas.kill("r0")
        for episode in episodes:
            for stream in (False, True):
                answer = _chat(proxy, episode, stream=stream)
                assert answer.status_code == 200, answer.text  # the kill costs no call
    rows = turns(db)
    assert len(rows) == 4 * len(episodes) and all(r["error"] is None and r["status_code"] == 200 for r in rows)
    for episode in episodes:
        served = [r["replica"] for r in rows if r["episode_id"] == episode]
        assert served[:2] == [before[episode]] * 2  # sticky
        assert served[2:] == ["r1", "r1"]  # after the kill: the other one
        assert all(r["upstream"] == replicas.urls[r["replica"]] for r in rows if r["episode_id"] == episode)


def test_a_5xx_takes_a_replica_out_until_its_probe_answers(tmp_path, record_env, fake_replicas):
    """A replica answering 500 leaves the rotation (the agent gets that one 500: the replica did answer); its
    episodes' next calls go elsewhere; once its probe lists the deployment again (after a back-off) it is back."""
    _, r1 = fake_replicas
    r1.fail = (500, {"error": {"message": "engine dead"}})
    db = tmp_path / "lcap.duckdb"
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        router = proxy._calls.router
        episode = next(e for e in (f"e{i}" for i in range(100)) if router.route(e).replica == "r1")
        assert _chat(proxy, episode).status_code == 500
        assert router.out_of_rotation() == {"r1"}
        r1.models = []  # serving, but not the deployment: still out after its probes (the first comes soon)
        assert _chat(proxy, episode).status_code == 200  # the next call: the other replica
        time.sleep(2.0)
        assert router.out_of_rotation() == {"r1"}
        r1.fail, r1.models = None, ["tiny"]
        deadline = time.monotonic() + 15
        while router.out_of_rotation() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not router.out_of_rotation()
        assert _chat(proxy, episode).status_code == 200  # back on its own replica
    assert [(r["replica"], r["status_code"]) for r in turns(db)] == [("r1", 500), ("r0", 200), ("r1", 200)]
    probes = [c for c in r1.requests if c["method"] == "GET" and c["path"] == "/v1/models"]
    assert 2 <= len(probes) <= 12  # probed again and again, with a back-off (0.5 s doubling), not in a loop


def test_a_replica_that_does_not_list_the_deployment_gets_no_calls(tmp_path, record_env, replicas):
    """The health probe asks /v1/models: a replica serving, but without the deployment the calls ask for (a
    restarted server whose adapters are not back yet), is out of the rotation."""
    _record({"r0": replicas.start("r0", ["tiny", "lora-1"]), "r1": replicas.start("r1", ["tiny"])}, current="lora-1")
    db = tmp_path / "lcap.duckdb"
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        router = proxy._calls.router
        router.health_interval = 0.1
        deadline = time.monotonic() + 10
        while router.out_of_rotation() != {"r1"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router.out_of_rotation() == {"r1"}
        for i in range(10):
            assert _chat(proxy, f"e{i}").status_code == 200
    assert {r["replica"] for r in turns(db)} == {"r0"}


def test_the_replica_key_goes_upstream_and_the_stored_replica_is_lcaps_own(tmp_path, record_env):
    """Replicas on the network require the record's key: lcap sends it in place of the agent's credentials. The
    stored replica is where lcap sent the call, whatever the agent writes in its headers or body."""
    servers = {name: FakeLLM(vllm=True) for name in ("r0", "r1")}
    for server in servers.values():
        server.models = ["tiny"]
        server.thread.start()
    key_file = tmp_path / "policy.key"
    key_file.write_text("replica-key-123")
    _record({name: server.url for name, server in servers.items()}, api_key_file=str(key_file))
    db = tmp_path / "lcap.duckdb"
    try:
        with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy, _client(proxy, "spoof") as client:
            for _ in range(3):
                answer = client.post(
                    "https://api.openai.com/v1/chat/completions",
                    json={**CHAT, "replica": "r9"},
                    headers={"authorization": "Bearer sk-agent", "x-lcap-replica": "r9"},
                )
                assert answer.status_code == 200
    finally:
        for server in servers.values():
            server.shutdown()
    rows = turns(db)
    (replica,) = {r["replica"] for r in rows}  # sticky
    assert [len(s.calls("/chat/completions")) for s in servers.values()] == [3 if n == replica else 0 for n in servers]
    assert all(r["upstream"] == servers[replica].url and r["request"]["replica"] == "r9" for r in rows)
    for call in servers[replica].calls("/chat/completions"):
        assert call["headers"]["authorization"] == "Bearer replica-key-123"
        assert [k for k in call["headers"] if k.lower() == "authorization"] == ["authorization"]


def test_a_call_mitmproxy_carries_reports_a_dead_replica(tmp_path, record_env, replicas):
    """Calls the front hands to mitmproxy (here: a chunked body) are not retried elsewhere: the first one to meet a
    killed replica gets a 502, and the replica leaves the rotation so the episode's next call goes to the other."""
    _record({"r0": replicas.start("r0", ["tiny"]), "r1": replicas.start("r1", ["tiny"])})
    db = tmp_path / "lcap.duckdb"
    body = json.dumps(CHAT).encode()
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        router = proxy._calls.router
        episode = next(e for e in (f"e{i}" for i in range(100)) if router.route(e).replica == "r0")
        replicas.kill("r0")
        with _client(proxy, episode) as client:
            url = "https://api.openai.com/v1/chat/completions"
            first = client.post(url, content=iter([body]), headers={"content-type": "application/json"})
            assert first.status_code == 502 and router.out_of_rotation() == {"r0"}
            second = client.post(url, content=iter([body]), headers={"content-type": "application/json"})
            assert second.status_code == 200
    assert [r["replica"] for r in turns(db)] == ["r0", "r1"]


def _restarting(record: PolicyServer) -> None:
    """Mark every replica draining, as `lcap deploy` does before it restarts the only one; wait until the proxy
    can have read it (capture/routing/routes.py REFRESH_S)."""
    for replica in record.replicas:
        replica.draining = True
    write_policy(record)
    time.sleep(0.6)


def test_calls_wait_while_the_only_replica_restarts_and_go_to_the_new_deployment(tmp_path, record_env):
    """While the record marks the only replica draining, calls through the front (whole and streamed) and through
    mitmproxy (a chunked body) wait in the proxy, none reaching the replica; once it serves the new deployment
    they are answered by it, and their turns say so."""
    server = FakeLLM(vllm=True)
    server.models = ["tiny"]
    server.thread.start()
    record = _record({"r0": server.url})
    db = tmp_path / "lcap.duckdb"
    body = json.dumps(CHAT).encode()

    def chunked(episode: str) -> httpx.Response:
        with _client(proxy, episode) as client:
            url = "https://api.openai.com/v1/chat/completions"
            return client.post(url, content=iter([body]), headers={"content-type": "application/json"})

    try:
        with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy, ThreadPoolExecutor(3) as pool:
            assert _chat(proxy, "before").status_code == 200
            _restarting(record)
            held = [pool.submit(_chat, proxy, "whole"), pool.submit(_chat, proxy, "streamed", stream=True)]
            held.append(pool.submit(chunked, "mitmproxy"))
            wait_until(lambda: proxy.counters()["calls_held"] == 3, 30)  # each call's TLS set-up (and hand-off) first
            assert not any(f.done() for f in held) and len(server.calls("/chat/completions")) == 1
            assert proxy.counters()["calls_held"] == 3

            def shown_held() -> list[str]:
                return [row[6] for row in proxies(View(db, time.time())).rows]

            wait_until(lambda: shown_held() == ["3 (3 held)"], 10)  # the announcer's next write with all three held
            shown = proxies(View(db, time.time()))
            assert [row[6] for row in shown.rows] == ["3 (3 held)"]
            assert shown.notes == [
                f"the proxy on port {proxy.port} holds 3 (calls, and Responses WebSocket openings) until a "
                "restarting policy replica serves again; its --hold-timeout answers them 503"
            ]
            server.models = ["tiny-v2"]  # restarted on the new checkpoint, back in the rotation
            record.replicas[0].draining = False
            record.current = record.served_model = "tiny-v2"
            write_policy(record)
            answers = [f.result(timeout=30) for f in held]
            assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
            assert proxy.counters()["calls_held"] == 0
    finally:
        server.shutdown()
    assert [c["body"]["model"] for c in server.calls("/chat/completions")] == ["tiny", *["tiny-v2"] * 3]
    rows = {r["episode_id"]: r for r in turns(db)}
    assert {e: (r["deployment"], r["status_code"], r["error"]) for e, r in rows.items()} == {
        "before": ("tiny", 200, None),
        **{e: ("tiny-v2", 200, None) for e in ("whole", "streamed", "mitmproxy")},
    }


def _responses_over_websocket(proxy: CaptureProxy, episode: str) -> str:
    """One `response.create` over a Responses WebSocket through the proxy; the text it answered."""
    from websockets.sync.client import connect

    env = proxy.child_env(episode, base={})
    ssl_context = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    with connect("wss://api.openai.com/v1/responses", proxy=env["HTTPS_PROXY"], ssl=ssl_context, open_timeout=60) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "gpt-5", "input": "Say hello"}))
        text = []
        while (event := json.loads(ws.recv(timeout=30)))["type"] != "response.completed":
            text += [event["delta"]] if event["type"] == "response.output_text.delta" else []
    return "".join(text)


def test_a_responses_websocket_opened_while_the_only_replica_restarts_opens_on_the_new_deployment(tmp_path, record_env):
    """A Responses WebSocket opened while the record marks the only replica draining waits in the proxy (its
    opening is held like a call), opens once the replica serves the new deployment, and its turn says so."""
    server = FakeLLM(vllm=True)
    server.models = ["tiny"]
    server.thread.start()
    record = _record({"r0": server.url})
    db = tmp_path / "lcap.duckdb"
    try:
        with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy, ThreadPoolExecutor(1) as pool:
            _restarting(record)
            answer = pool.submit(_responses_over_websocket, proxy, "ws")
            wait_until(lambda: proxy.counters()["calls_held"] == 1, 30)
            assert not answer.done() and not [r for r in server.requests if r["method"] == "WS"]
            assert proxy.counters()["calls_held"] == 1
            server.models = ["tiny-v2"]
            record.replicas[0].draining = False
            record.current = record.served_model = "tiny-v2"
            write_policy(record)
            assert answer.result(timeout=30)
            assert proxy.counters()["calls_held"] == 0
    finally:
        server.shutdown()
    assert [r["body"]["model"] for r in server.requests if r["method"] == "WS"] == ["tiny-v2"]
    assert [(r["episode_id"], r["transport"], r["deployment"], r["status_code"]) for r in turns(db)] == [
        ("ws", "websocket", "tiny-v2", 200)
    ]


def test_a_held_call_ends_with_a_503_past_its_timeout_or_the_bound_and_its_agent_can_leave(tmp_path, record_env):
    """The only replica is marked draining and never comes back: a held call gets a 503 naming --hold-timeout once
    it passes, a call (or a Responses WebSocket's opening) past --max-held-calls gets one at once, and a held call
    whose agent leaves stops waiting then; each call is stored as an error turn, and the 503s are counted."""
    server = FakeLLM(vllm=True)
    server.models = ["tiny"]
    server.thread.start()
    record = _record({"r0": server.url})
    db = tmp_path / "lcap.duckdb"
    options = ProxyOptions(upstream="policy", hold_timeout=6.0, max_held_calls=1)
    with CaptureProxy(Store(db), options) as proxy, ThreadPoolExecutor(1) as pool:
        server.shutdown()
        _restarting(record)
        started = time.monotonic()
        timed_out = pool.submit(_chat, proxy, "timed-out")
        wait_until(lambda: proxy.counters()["calls_held"] == 1, 6.0)  # held (its TLS set-up may take a while)
        held = time.monotonic()
        over = _chat(proxy, "over-the-bound")
        assert over.status_code == 503 and "(--max-held-calls 1)" in over.text, over.text
        with pytest.raises(InvalidStatus) as refused:  # a Responses WebSocket's opening is held, and bound, alike
            _responses_over_websocket(proxy, "websocket-over-the-bound")
        assert refused.value.response.status_code == 503 and b"(--max-held-calls 1)" in refused.value.response.body
        assert time.monotonic() - held < 5.0  # refused at once, not after the 6 s hold
        answer = timed_out.result(timeout=30)
        assert answer.status_code == 503 and "within 6 s (--hold-timeout)" in answer.text, answer.text
        assert time.monotonic() - started >= 6.0 and time.monotonic() - held < 9.0

        with _client(proxy, "left") as client, pytest.raises(httpx.ReadTimeout):
            client.post("https://api.openai.com/v1/chat/completions", json=CHAT, timeout=httpx.Timeout(30, read=1.0))
        wait_until(lambda: proxy.counters()["calls_held"] == 0, 3.0)
        assert proxy.counters()["calls_held"] == 0  # long before its 6 s were up
        assert proxy.counters()["calls_hold_refused"] == 3
    rows = {r["episode_id"]: (r["status_code"], r["error"]) for r in turns(db)}
    assert rows == {
        "timed-out": (503, "no policy replica served again within 6 s (--hold-timeout)"),
        "over-the-bound": (503, "too many calls wait for a restarting policy replica (--max-held-calls 1)"),
        "left": (None, "the agent closed the connection before the answer"),
    }
