"""`lcap serve --ray`: a replica as a Ray actor running the real vLLM CPU server, on a real local Ray cluster.

What runs here: the actor's whole logic (placement with `--gpus-per-replica 0`, vLLM started on the node's
address behind its key, the key file, adapters shipped through the object store and hot-loaded, a
vLLM that dies started again with its adapters, `--status`, `--stop`), the proxy routing to it with
the key. What cannot run here: GPU placement (`num_gpus` from the tensor-parallel size) and a
multi-node cluster; the cluster is one node of this machine.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fixtures_capture import turns

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.policy import read_policy
from lcap.store import Store

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LCAP = str(Path(sys.executable).parent / "lcap")
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGES = {"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _actor_state(record) -> dict:
    import ray

    from lcap.serve.ray_replicas import NAMESPACE

    actor = ray.get_actor(record.replicas[0].actor, namespace=NAMESPACE)
    return ray.get(actor.describe.remote(), timeout=60)


def test_a_ray_replica_serves_behind_its_key_with_shipped_adapters_and_comes_back(
    ray_cluster, tiny_model_dir, tiny_lora, tmp_path, monkeypatch
):
    import ray

    from lcap.config import LcapError
    from lcap.serve.deploy import deploy_policy
    from lcap.serve.vllm_process import resolve_python

    try:
        python = resolve_python()
    except LcapError as exc:
        pytest.skip(f"vLLM cannot be installed or imported here: {exc}")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("LCAP_HOME", str(home))
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(home / "policy.json"))
    db = tmp_path / "lcap.duckdb"
    serve = [LCAP, "serve", "-m", str(tiny_model_dir), "--name", "tiny", "--python", python, "--timeout", "900"]
    started = subprocess.run(
        [*serve, "--ray", ray_cluster, "--gpus-per-replica", "0", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    try:
        assert started.returncode == 0, f"{started.stdout}\n{started.stderr[-4000:]}"
        record = read_policy()
        (replica,) = record.replicas
        assert record.ray_address == ray_cluster and replica.actor and replica.node
        assert replica.pid is None and replica.url.startswith(f"http://{replica.node}:")
        key_file = Path(record.api_key_file)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        assert key not in (home / "policy.json").read_text()
        auth = {"authorization": f"Bearer {key}"}

        # vLLM on the node's address answers only with the key, on every path but /health.
        assert httpx.get(f"{replica.url}/health", timeout=30).status_code == 200
        for method, path in (("GET", "/v1/models"), ("POST", "/invocations"), ("POST", "/tokenize")):
            assert httpx.request(method, f"{replica.url}{path}", json={}, timeout=30).status_code == 401
        models = httpx.get(f"{replica.url}/v1/models", headers=auth, timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["tiny"]

        # vLLM started as a local replica is, with lcap's policy endpoints, which the key guards too; `lcap serve`
        # found them (its check sends the key).
        assert record.lcap_endpoints
        lcap_chat = f"{replica.url}/lcap/v1/chat/completions"
        assert httpx.post(lcap_chat, json={**CHAT, "model": "tiny"}, timeout=30).status_code == 401
        direct = httpx.post(lcap_chat, json={**CHAT, "model": "tiny"}, headers=auth, timeout=300)
        assert direct.status_code == 200, direct.text
        answer_part, record_part, _ = direct.content.split(b"\n", 2)  # the answer, then lcap's record and head
        assert json.loads(answer_part)["model"] == "tiny" and json.loads(record_part)["stitched"] is False

        # The proxy sends the key; an adapter reaches the node through Ray, not through the path. Messages calls
        # get exact ids only from lcap's endpoints; the second chat call extends the first and is stitched.
        with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
            env = proxy.child_env("ep-1", base={})
            with httpx.Client(proxy=env["HTTPS_PROXY"], verify=env["SSL_CERT_FILE"], timeout=120) as client:
                first = client.post("https://api.openai.com/v1/chat/completions", json=CHAT)
                assert first.status_code == 200
                said = first.json()["choices"][0]["message"]
                later = [*CHAT["messages"], {"role": "assistant", "content": said["content"]}]
                later.append({"role": "user", "content": "and?"})
                assert (
                    client.post(
                        "https://api.openai.com/v1/chat/completions", json={**CHAT, "messages": later}
                    ).status_code
                    == 200
                )
                assert client.post("https://api.anthropic.com/v1/messages", json=MESSAGES).status_code == 200
                name = deploy_policy(tiny_lora, round=1, store=Store(db))
                time.sleep(0.7)
                answer = client.post("https://api.openai.com/v1/chat/completions", json=CHAT)
                assert answer.status_code == 200 and answer.json()["model"] == name
        rows = turns(db)
        assert [(r["replica"], r["deployment"], r["token_source"]) for r in rows] == [
            ("r0", "tiny", "vllm"),
            ("r0", "tiny", "vllm"),
            ("r0", "tiny", "vllm"),
            ("r0", name, "vllm"),
        ]
        # A call cut by max_tokens ends its conversation's thread: the next is stitched only after a stop.
        first_ended = first.json()["choices"][0]["finish_reason"] == "stop"
        assert [r["stitched"] for r in rows[:3]] == [False, first_ended, False], [r["stitch_note"] for r in rows]
        messages = rows[2]
        assert messages["dialect"] == "messages" and len(messages["completion_token_ids"]) > 0
        assert len(messages["completion_logprobs"]) == len(messages["completion_token_ids"])
        models = httpx.get(f"{replica.url}/v1/models", headers=auth, timeout=30).json()["data"]
        (lora,) = [m for m in models if m["id"] == name]
        assert lora["root"] != str(tiny_lora) and f"loras/{name}" in lora["root"]  # the actor's own copy

        # The node's address as the cluster knows it (`lcap deploy` joined it in this process).
        assert replica.node in {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}

        # vLLM dies on its node: the actor starts it again, with the adapter, on the same address.
        state = _actor_state(record)
        assert state["loras"] == [name] and state["restarts"] == 0
        os.killpg(state["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 900
        while True:
            try:
                served = httpx.get(f"{replica.url}/v1/models", headers=auth, timeout=10).json()["data"]
                if name in {m["id"] for m in served}:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, "the actor did not bring vLLM back"
            time.sleep(1)
        state = _actor_state(record)
        assert state["restarts"] == 1 and state["alive"] and state["pid"] != replica.pid

        status = subprocess.run([LCAP, "serve", "--status"], capture_output=True, text=True, timeout=300)
        assert status.returncode == 0, status.stdout + status.stderr
        assert json.loads(status.stdout)["replicas"][0]["alive"]
    finally:
        stopped = subprocess.run([LCAP, "serve", "--stop"], capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 0 and "stopped policy server" in stopped.stdout, stopped.stderr
    assert read_policy() is None and not key_file.exists()
    with pytest.raises(ValueError):
        from lcap.serve.ray_replicas import NAMESPACE

        ray.get_actor(replica.actor, namespace=NAMESPACE)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{replica.url}/health", timeout=5)
    ray.shutdown()
