"""Serving per role on the real vLLM CPU server (the tiny model, several LoRA adapters loaded at once): each call
goes to its role's adapter and its turn names it, a role rolls back alone, and a deploy of two roles is atomic under
concurrent calls."""

from __future__ import annotations

import json
import ssl
import threading
import time
from pathlib import Path

import httpx
import pytest
from fixtures_capture import turns
from fixtures_vllm import make_lora
from openai import OpenAI
from typer.testing import CliRunner

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.cli import app
from lcap.policy import read_policy
from lcap.store import Store

pytestmark = pytest.mark.vllm

SOLVER_SYSTEM = "You solve the arithmetic the planner wrote."


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Four adapters of the tiny model, each with other random B matrices: two per role."""
    root = tmp_path_factory.mktemp("role-adapters")
    return {
        f"{role}{round}": make_lora(tiny_model_dir, root / f"{role}{round}", seed=seed)
        for seed, (role, round) in enumerate((("planner", 1), ("solver", 1), ("planner", 2), ("solver", 2)), start=11)
    }


def _client(proxy: CaptureProxy, episode: str, role: str | None) -> tuple[OpenAI, httpx.Client]:
    env = proxy.child_env(episode, base={})
    http = httpx.Client(
        proxy=env["HTTPS_PROXY"], verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"]), timeout=300
    )
    headers = {"X-Lcap-Role": role} if role else None
    return OpenAI(api_key="sk-test", http_client=http, max_retries=0, default_headers=headers), http


def _call(client: OpenAI, system: str | None = None) -> str:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": "What is 2 + 2?"})
    return client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=4).model


def _served(rows: list[dict]) -> list[tuple[str, str, str]]:
    return [(r["role"], r["deployment"], r["model_served"]) for r in rows]


def test_each_roles_calls_land_on_its_adapter_and_a_role_rolls_back_alone(vllm_policy, adapters, tmp_path):
    """One episode's calls of three roles (two by header, one by a --role-by rule, one with none) are each served by
    its role's adapter, which vLLM names as the model it ran; rolling one role back changes it and nothing else."""
    from lcap.serve.deploy import deploy_roles

    db = tmp_path / "lcap.duckdb"
    store = Store(db)
    first = deploy_roles({"planner": adapters["planner1"], "solver": adapters["solver1"]}, round=1, store=store)
    assert first["planner"].startswith("policy-planner-r1-") and first["solver"].startswith("policy-solver-r1-")
    second = deploy_roles({"planner": adapters["planner2"]}, round=2, store=store)
    base = vllm_policy.served_model
    options = ProxyOptions(upstream="policy", role_by=(f"system:{SOLVER_SYSTEM}=solver",))

    def run_episode(episode: str) -> None:
        with CaptureProxy(Store(db), options) as proxy:
            for role, system in (("planner", None), (None, SOLVER_SYSTEM), (None, None)):
                client, http = _client(proxy, episode, role)
                with http:
                    _call(client, system)

    run_episode("e1")
    roles = {"default": base, "planner": second["planner"], "solver": first["solver"]}
    status = CliRunner().invoke(app, ["status", "--json", "--db", str(db)])
    assert status.exit_code == 0, status.output
    assert json.loads(status.output)["policy"]["role_deployments"] == roles
    served = CliRunner().invoke(app, ["serve", "--status"])
    assert served.exit_code == 0, served.output
    assert json.loads(served.output)["role_deployments"] == roles
    assert _served(turns(db, "episode_id = 'e1'")) == [
        ("planner", second["planner"], second["planner"]),
        ("solver", first["solver"], first["solver"]),
        ("default", base, base),
    ]

    result = CliRunner().invoke(app, ["deploy", "--rollback", "--role", "planner", "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"{first['planner']} (rolled back from {second['planner']})"
    assert read_policy().role_deployments() == {"default": base, "planner": first["planner"], "solver": first["solver"]}
    run_episode("e2")
    assert [d for _, d, _ in _served(turns(db, "episode_id = 'e2'"))] == [first["planner"], first["solver"], base]

    # Before its first adapter, the planner was served by the default's deployment: so it is again.
    result = CliRunner().invoke(app, ["deploy", "--rollback", "--role", "planner", "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert read_policy().role_deployments() == {"default": base, "solver": first["solver"]}
    run_episode("e3")
    assert [d for _, d, _ in _served(turns(db, "episode_id = 'e3'"))] == [base, first["solver"], base]
    assert store.fetchall("SELECT role, kind, round FROM deployments ORDER BY created_at, rowid") == [
        ("planner", "lora", 1),
        ("solver", "lora", 1),
        ("planner", "lora", 2),
        ("planner", "lora", 1),  # the first rollback
        ("planner", "default", None),  # the second: back on the default's deployment
    ]


def test_a_two_role_deploy_is_atomic_under_concurrent_calls(vllm_policy, adapters, tmp_path, monkeypatch):
    """Both roles move from round 1's adapters to round 2's in one deploy while agents call as planner and as solver
    without pause. No call may see half of it, checked two ways:
    - per record version: right after each record the deploy publishes (`lcap.policy.publish` returns once every
      router routes by it), a probe call of each role is routed by that version; each version's pair must be
      both-old or both-new (a deploy that wrote the roles one after the other publishes a planner-new,
      solver-old version, which its probes show);
    - over time: the proxy routes each call when its body is whole and stamps `started_at` then, on its one event
      loop, so every call routed by the old record started before every call routed by the new one, of either role.
    Every call is stored with the adapter vLLM names as the model it ran."""
    import lcap.serve.deploy as deploy

    db = tmp_path / "lcap.duckdb"
    old = deploy.deploy_roles({"planner": adapters["planner1"], "solver": adapters["solver1"]}, round=1)
    stop = threading.Event()
    errors: list[str] = []
    versions: list[str] = []  # the probes' episode ids, one per published record

    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:

        def agent(worker: int) -> None:
            role = ("planner", "solver")[worker % 2]
            n = 0
            while not stop.is_set():
                client, http = _client(proxy, f"w{worker}-e{n}", role)
                with http:
                    for _ in range(2):
                        try:
                            _call(client)
                        except Exception as exc:  # kept: a failed call fails the test below
                            errors.append(f"{role}: {exc}")
                n += 1

        def publish_then_probe(record) -> None:
            publish(record)
            episode = f"probe-{len(versions)}"
            versions.append(episode)
            for role in ("planner", "solver"):
                client, http = _client(proxy, episode, role)
                with http:
                    _call(client)

        publish = deploy.publish
        monkeypatch.setattr(deploy, "publish", publish_then_probe)
        workers = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(4)]
        for worker in workers:
            worker.start()
        time.sleep(3)
        new = deploy.deploy_roles({"planner": adapters["planner2"], "solver": adapters["solver2"]}, round=2)
        time.sleep(3)
        stop.set()
        for worker in workers:
            worker.join(300)
    assert not errors, errors[:3]

    rows = turns(db)
    assert all(r["status_code"] == 200 and r["deployment"] == r["model_served"] for r in rows), _served(rows)[:5]
    generation = {old[role]: (role, 1) for role in old} | {new[role]: (role, 2) for role in new}
    assert all(generation[r["deployment"]][0] == r["role"] for r in rows), _served(rows)

    probes = {e: [generation[r["deployment"]][1] for r in rows if r["episode_id"] == e] for e in versions}
    assert versions and all(g in ([1, 1], [2, 2]) for g in probes.values()), f"a record routed half a deploy: {probes}"
    assert probes[versions[-1]] == [2, 2]

    seen = [(r["started_at"], *generation[r["deployment"]]) for r in rows if not r["episode_id"].startswith("probe")]
    assert {(role, g) for _, role, g in seen} == {("planner", 1), ("solver", 1), ("planner", 2), ("solver", 2)}, (
        "the agents' calls did not span the deploy: the test checked nothing"
    )
    last_old = max(started for started, _, g in seen if g == 1)
    first_new = min(started for started, _, g in seen if g == 2)
    assert last_old < first_new, (
        f"a call routed by the old record started at {last_old}, after a new one at {first_new}"
    )
