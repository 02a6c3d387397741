"""Serving per role: the policy record's roles (an old record reads as the default role alone), `lcap deploy`'s
--role arguments, the router's route per role, and a role's rollback that leaves the others (on real vLLM:
tests/e2e/test_serve_roles.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lcap.capture.routing.routes import Router
from lcap.config import LcapError
from lcap.policy import DEFAULT_ROLE, PolicyServer, Replica, read_policy, write_policy
from lcap.serve.options import DeployOptions, deploy_targets
from lcap.store import Store

OLD = {  # a record as `lcap serve` wrote it before roles
    "url": "http://127.0.0.1:8123",
    "pid": 4242,
    "base_model": "/m",
    "served_model": "m",
    "current": "policy-r1-abc",
    "log_path": "/logs/vllm-8123.log",
    "python": "/py",
    "started_at": "",
    "loras": {"policy-r1-abc": "/a"},
    "replicas": [{"name": "r0", "url": "http://127.0.0.1:8123", "pid": 4242}],
}


def _record(roles: dict[str, str], current: str = "m") -> PolicyServer:
    loras = {name: f"/adapters/{name}" for name in ("lora-a", "lora-b", "lora-p1", "lora-p2", "lora-s1")}
    return PolicyServer("http://127.0.0.1:8123", None, "/m", "m", current, "", "py", "", loras=loras, roles=roles)


def test_an_old_record_without_roles_reads_as_the_default_role_alone(record_env):
    Path(os.environ["LCAP_POLICY_RECORD"]).write_text(json.dumps(OLD))
    record = read_policy()
    assert record.roles == {}
    assert record.role_deployments() == {DEFAULT_ROLE: "policy-r1-abc"}
    assert record.deployment_of("planner") == record.deployment_of(None) == "policy-r1-abc"
    router = Router("policy", None)
    try:
        for role in (None, DEFAULT_ROLE, "planner"):
            route = router.route("e1", role=role)
            assert (route.model, route.deployment, route.replica) == ("policy-r1-abc", "policy-r1-abc", "r0")
    finally:
        router.close()


def test_the_record_lists_each_roles_deployment_and_round_trips(record_env):
    write_policy(_record({"solver": "lora-b", "planner": "lora-a"}, current="lora-p1"))
    written = json.loads(Path(os.environ["LCAP_POLICY_RECORD"]).read_text())
    assert written["roles"] == {"solver": "lora-b", "planner": "lora-a"} and written["current"] == "lora-p1"
    record = read_policy()
    assert record.role_deployments() == {"default": "lora-p1", "planner": "lora-a", "solver": "lora-b"}
    assert record.deployment_of("solver") == "lora-b" and record.deployment_of("coder") == "lora-p1"
    assert record.in_use() == {"lora-p1", "lora-a", "lora-b"}
    # `default` is `current`: a roles entry for it is not a second truth
    assert PolicyServer(**{**written, "roles": {"default": "lora-b"}}).deployment_of(DEFAULT_ROLE) == "lora-p1"


def test_a_role_with_its_own_adapter_asks_for_it_and_the_others_for_the_defaults():
    """A role's adapter outranks a replica's own `current` (a full checkpoint rolling out serves the default role)."""
    record = _record({"planner": "lora-a"})
    replica = Replica("r0", "http://127.0.0.1:8123", current="tiny-r2")
    assert replica.serving(record, "planner") == "lora-a"
    assert replica.serving(record, "solver") == replica.serving(record) == "tiny-r2"


def test_the_router_sends_each_role_to_its_adapter_from_one_read_of_the_record(record_env):
    write_policy(_record({"planner": "lora-a", "solver": "lora-b"}))
    router = Router("policy", None)
    try:
        routes = {role: router.route("e1", role=role) for role in ("planner", "solver", "coder", None)}
        assert {role: (r.model, r.deployment) for role, r in routes.items()} == {
            "planner": ("lora-a", "lora-a"),
            "solver": ("lora-b", "lora-b"),
            "coder": ("m", "m"),  # no deployment of its own: the default's
            None: ("m", "m"),
        }
        assert len({(r.host, r.port, r.replica) for r in routes.values()}) == 1  # the episode's replica, every role
    finally:
        router.close()


def test_a_proxy_pinned_to_an_adapter_labels_every_roles_calls_with_it(record_env):
    """`lcap loop --live` evaluates a candidate through a proxy asking for it: its calls are the candidate's, whatever
    their role."""
    write_policy(_record({"planner": "lora-a"}))
    router = Router("policy", "lora-p2")
    try:
        assert {router.route("e1", role=role).deployment for role in ("planner", None)} == {"lora-p2"}
    finally:
        router.close()


def test_a_proxy_with_role_pins_sends_each_pinned_roles_calls_to_its_candidate_and_the_others_to_theirs(record_env):
    """`lcap loop --per-role` evaluates a round's candidates (one adapter per trained role, loaded beside the
    deployments) through a proxy pinning each role to its candidate: a pinned role asks for its candidate and is
    labelled with it, an unpinned role keeps its deployment, a pin to an adapter the server does not serve is none."""
    write_policy(_record({"planner": "lora-a", "solver": "lora-b"}, current="lora-p1"))
    router = Router("policy", None, role_models={"planner": "lora-p2", "default": "lora-s1", "solver": "gone"})
    try:
        routes = {role: router.route("e1", role=role) for role in ("planner", "solver", "coder", None)}
        assert {role: (r.model, r.deployment) for role, r in routes.items()} == {
            "planner": ("lora-p2", "lora-p2"),
            "solver": ("lora-b", "lora-b"),  # its pin names no served adapter: its deployment
            "coder": ("lora-s1", "lora-s1"),  # no deployment of its own: the default's, pinned
            None: ("lora-s1", "lora-s1"),
        }
    finally:
        router.close()


@pytest.mark.parametrize(
    ("roles", "path", "rollback", "targets"),
    [
        ((), "RUN/round-1/adapter", False, {"default": "RUN/round-1/adapter"}),
        (("planner",), "P", False, {"planner": "P"}),
        (("planner=P", "solver=S"), None, False, {"planner": "P", "solver": "S"}),
        (("default=D", "solver=a=b"), None, False, {"default": "D", "solver": "a=b"}),
        (("planner",), None, True, {"planner": None}),
        (("planner",), "policy-planner-r1-aa", True, {"planner": "policy-planner-r1-aa"}),
        ((), None, True, {"default": None}),
    ],
)
def test_deploy_takes_a_path_alone_a_role_and_a_path_or_role_path_pairs(roles, path, rollback, targets):
    assert deploy_targets(roles, path, rollback=rollback) == targets
    assert DeployOptions(role=roles, rollback=rollback).targets(path) == targets


@pytest.mark.parametrize(
    ("roles", "path", "rollback", "why"),
    [
        (("planner", "solver"), "P", False, "several roles at once: give each its adapter"),
        (("planner=P", "solver"), None, False, "either --role R with PATH, or --role R=PATH"),
        (("planner=P",), "Q", False, "every adapter is given with its role, not as PATH"),
        (("planner=P", "planner=Q"), None, False, "--role planner is given twice"),
        (("planner=",), None, False, "give the adapter to deploy for planner"),
        (("plan ner",), "P", False, "a role is 1-64 letters"),
        (("../up=P",), None, False, "a role is 1-64 letters"),
        (("planner=P", "solver=S"), None, True, "--rollback rolls back one role"),
    ],
)
def test_deploy_arguments_that_mix_the_forms_are_refused_in_one_line(roles, path, rollback, why):
    with pytest.raises(LcapError, match=why.replace("(", r"\(")):
        deploy_targets(roles, path, rollback=rollback)


def test_rolling_back_one_role_leaves_the_others_and_walks_back_to_the_default(record_env, tmp_path):
    """Each rollback is one record write that changes the role named only; before its first adapter, the role is
    served by the default's deployment again, and the store says so."""
    from lcap.serve.deploy import record_deployment
    from lcap.serve.rollback import rollback

    store = Store(tmp_path / "lcap.duckdb")
    record = _record({"planner": "lora-p2", "solver": "lora-s1"}, current="lora-a")
    write_policy(record)
    for name, role in (("lora-a", "default"), ("lora-p1", "planner"), ("lora-s1", "solver"), ("lora-p2", "planner")):
        record_deployment(store, record, name, f"/adapters/{name}", "lora", 1, role=role)

    assert rollback(store, role="planner") == ("lora-p1", "lora-p2")
    assert read_policy().role_deployments() == {"default": "lora-a", "planner": "lora-p1", "solver": "lora-s1"}
    assert rollback(store, role="planner") == ("lora-a (the default role's)", "lora-p1")
    assert read_policy().role_deployments() == {"default": "lora-a", "solver": "lora-s1"}
    with pytest.raises(LcapError, match="role 'planner' has no deployment of its own"):
        rollback(store, role="planner")
    assert store.fetchall("SELECT name, kind, role, rollback_of FROM deployments WHERE rollback_of IS NOT NULL") == [
        ("lora-p1", "lora", "planner", "lora-p2"),
        ("lora-a", "default", "planner", "lora-p1"),
    ]
    with pytest.raises(LcapError, match="no deployment 'lora-p9' of role solver in this store"):
        rollback(store, "lora-p9", role="solver")
    # the default role's history is its own (the other roles' rows are not in it), and its rollback leaves them
    assert rollback(store) == ("m", "lora-a")  # before its first adapter: the base model the server runs
    assert read_policy().role_deployments() == {"default": "m", "solver": "lora-s1"}


def test_a_full_checkpoint_is_refused_while_a_role_has_an_adapter_of_its_own(record_env, tmp_path):
    from lcap.serve.deploy import deploy_policy, deploy_roles

    write_policy(_record({"planner": "lora-a"}))
    checkpoint = tmp_path / "round-2" / "checkpoint"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(LcapError, match=r"role\(s\) planner have adapters of their own"):
        deploy_policy(checkpoint)
    with pytest.raises(LcapError, match=r"--role solver: .* is not a LoRA adapter"):
        deploy_roles({"solver": checkpoint})
    with pytest.raises(LcapError, match=r"--role solver: .*/gone does not exist"):
        deploy_roles({"solver": tmp_path / "gone"})
    with pytest.raises(LcapError, match="--name names one deployment"):
        deploy_roles({"solver": checkpoint, "planner": checkpoint}, name="x")
    assert read_policy().role_deployments() == {"default": "m", "planner": "lora-a"}  # nothing changed
