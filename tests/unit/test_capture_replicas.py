"""A policy record from before replicas reads as one replica (routing to live replicas:
tests/integration/test_capture_replicas.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lcap.capture.routing.routes import Router
from lcap.policy import read_policy, write_policy


def test_an_old_single_server_record_is_one_replica(record_env, tmp_path):
    """A record written before replicas (no `replicas` key) reads as replica r0 and routes as before."""
    old = {
        "url": "http://127.0.0.1:8123",
        "pid": 4242,
        "base_model": "/m",
        "served_model": "m",
        "current": "policy-r1-abc",
        "log_path": "/logs/vllm-8123.log",
        "python": "/py",
        "started_at": "",
        "loras": {"policy-r1-abc": "/a"},
    }
    Path(os.environ["LCAP_POLICY_RECORD"]).write_text(json.dumps(old))
    record = read_policy()
    assert [(r.name, r.url, r.pid, r.log_path) for r in record.replicas] == [
        ("r0", "http://127.0.0.1:8123", 4242, "/logs/vllm-8123.log")
    ]
    assert record.tool_parser == "hermes" and record.ray_address is None and record.api_key() is None
    router = Router("policy", None)
    route = router.route("any")
    assert (route.host, route.port, route.model, route.deployment, route.replica) == (
        "127.0.0.1",
        8123,
        "policy-r1-abc",
        "policy-r1-abc",
        "r0",
    )
    router.close()
    write_policy(record)  # written back: the replicas are listed, the old fields still name the first
    again = json.loads(Path(os.environ["LCAP_POLICY_RECORD"]).read_text())
    assert again["url"] == old["url"] and again["pid"] == 4242 and again["replicas"][0]["name"] == "r0"
