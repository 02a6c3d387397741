"""The policy record's one publisher, `lcap.policy.publish`: atomic, in a folder it makes if need be, and routed by
every router once it returns (deploys through live replicas: tests/e2e/test_serve_replicas.py)."""

from __future__ import annotations

from lcap.capture.routing.routes import Router
from lcap.policy import PolicyServer, publish, read_policy, write_policy


def _record(current: str) -> PolicyServer:
    return PolicyServer("http://127.0.0.1:8123", None, "/m", "m", current, "", "python", "", loras={"lora-1": "/a"})


def test_publish_makes_the_records_folder(tmp_path, monkeypatch):
    """LCAP_HOME (or LCAP_POLICY_RECORD) naming a folder that does not exist yet: the record is written there, the
    user's alone."""
    path = tmp_path / "fresh" / "home" / "policy.json"
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(path))
    publish(_record("m"))
    assert read_policy() == _record("m")
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["policy.json"]  # no temporary file left


def test_a_router_routes_by_the_published_record_once_publish_returns(tmp_path, monkeypatch):
    """A router that has just looked at the record (so its next look is due REFRESH_S later) routes the very next
    call by a record published meanwhile: publish waited for that look instead of its writer sleeping."""
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    write_policy(_record("m"))
    router = Router("policy", None)
    try:
        assert router.route("e1").deployment == "m"
        record = read_policy()
        record.current = "lora-1"
        publish(record)
        assert router.route("e1").deployment == "lora-1"
    finally:
        router.close()
