"""`lcap doctor`: every check passing and failing, each failure with its fix (applied where the test can, to see
it work). Real parts: lcap's CA and bundle, Python/curl/Node/Java clients against a local TLS server, the Node
preload, spools with sealed records, a throwaway proxy, DuckDB stores (one locked by another process), the vLLM
CPU server (marked vllm). A stand-in HTTP server plays a vLLM started without LoRA (starting a second real one
costs minutes here), and a throwaway package plays an installed Ray."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fixtures_doctor import run_checks, sealed_spool

LCAP = str(Path(sys.executable).parent / "lcap")


TRUST = ("ca.bundle", "trust.python", "trust.curl", "trust.node", "roundtrip")


def test_broken_bundle_fails_trust_and_the_round_trip_until_removed(home):
    """A bundle that is no bundle (newer than the CA, so lcap keeps giving it to children): the bundle check, every
    client and the live round trip fail; the fix (remove it: lcap writes it again) makes them pass."""
    if shutil.which("curl") is None or shutil.which("node") is None:
        pytest.skip("curl and node are needed")
    run_checks("ca.bundle")
    bundle = home / "ca" / "bundle.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    broken = run_checks(*TRUST)
    assert broken["ca.bundle"].status == "fail" and "holds no readable certificate" in broken["ca.bundle"].summary
    assert broken["ca.bundle"].fix.startswith(f"rm {bundle}")
    for name in ("trust.python", "trust.curl", "trust.node"):
        assert broken[name].status == "fail", (name, broken[name])
    assert (
        "urllib: URLError" in broken["trust.python"].summary
        and "CERTIFICATE_VERIFY_FAILED" in broken["trust.python"].summary
    )
    assert "curl:" in broken["trust.curl"].summary
    assert "node fetch" in broken["trust.node"].summary
    assert broken["roundtrip"].status == "fail" and "the call through the proxy failed" in broken["roundtrip"].summary

    bundle.unlink()
    fixed = run_checks(*TRUST)
    assert {name: r.status for name, r in fixed.items()} == dict.fromkeys(("ca", *TRUST), "ok"), fixed
    assert set(fixed["trust.python"].details["clients"]) >= {"urllib", "httpx"}
    assert "answered, stored, read back" in fixed["roundtrip"].summary


@pytest.mark.skipif(shutil.which("java") is None, reason="needs a JDK")
def test_java_trusts_lcaps_store_and_fails_with_a_broken_one(home, monkeypatch):
    """lcap gives a JVM child its trust store in JAVA_TOOL_OPTIONS (after the user's own options); a store Java
    cannot read fails, and removing it (as the fix says) makes lcap write it again."""
    from lcap.capture.reach.jvm import TRUST_STORE

    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Xss2m")
    assert run_checks("trust.java")["trust.java"].status == "ok"
    store = home / "ca" / TRUST_STORE
    store.write_bytes(b"not a key store")
    found = run_checks("trust.java")["trust.java"]
    assert found.status == "fail" and str(store) in found.fix, found
    store.unlink()
    assert run_checks("trust.java")["trust.java"].status == "ok"


def test_node_preload_passes_installed_warns_never_installed_and_fails_wrong(home, node_modules, monkeypatch, tmp_path):
    """Never installed is a warning (a Python-only user's doctor passes: issue #38); a wrong version fails."""
    from fixtures_capture import node_cache_dir

    monkeypatch.setenv("LCAP_NODE_DIR", str(node_cache_dir()))
    assert run_checks("node.preload")["node.preload"].status == "ok"
    monkeypatch.setenv("LCAP_NODE_DIR", str(tmp_path / "empty"))
    found = run_checks("node.preload")["node.preload"]
    assert found.status == "warn" and "the Node preload is not installed" in found.summary, found
    assert found.fix.startswith("lcap setup node")
    stale = tmp_path / "empty" / "node_modules" / "undici"
    stale.mkdir(parents=True)
    (stale / "package.json").write_text('{"version": "5.0.0"}')
    found = run_checks("node.preload")["node.preload"]
    assert found.status == "fail" and "undici 5.0.0 (wants 6.21.3)" in found.summary, found
    assert "https-proxy-agent missing" in found.summary and found.fix.startswith("lcap setup node")


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_full_spool_of_an_ended_proxy_fails_and_its_fix_stores_the_turns(home, tmp_path):
    from lcap.store import Store

    db = tmp_path / "lcap.duckdb"
    Store(db).execute("SELECT 1")
    directory = sealed_spool(home, _dead_pid(), db, 5)
    found = run_checks("spool.backlog")["spool.backlog"]
    assert found.status == "fail", found
    assert "5 turns" in found.summary and f"wait in {directory}" in found.summary
    fix = f"lcap proxy --db {db.resolve()} -- true"
    assert fix in found.fix
    done = subprocess.run([LCAP, *shlex.split(fix)[1:]], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert run_checks("spool.backlog")["spool.backlog"].status == "ok"
    assert Store(db).fetchall("SELECT count(*) FROM turns WHERE episode_id = 'ep'") == [(5,)]


def _record(pid: int, url: str, current: str = "tiny") -> None:
    from lcap.policy import PolicyServer, write_policy

    write_policy(
        PolicyServer(url, pid, "/models/tiny", "tiny", current, "/tmp/vllm.log", "python", "2026-01-01T00:00:00")
    )


def test_stopped_policy_server_fails_with_the_restart(home):
    assert run_checks("policy.server")["policy.server"].status == "skip"  # nothing recorded: nothing to check
    _record(_dead_pid(), "http://127.0.0.1:9")
    found = run_checks("policy.lora", "policy.model")
    assert found["policy.server"].status == "fail" and "is not running" in found["policy.server"].summary
    assert found["policy.server"].fix.startswith("lcap serve --stop && lcap serve --model /models/tiny")
    assert found["policy.model"].status == found["policy.lora"].status == "skip"

    _record(os.getpid(), "http://127.0.0.1:9")  # a live process, but nothing answers
    found = run_checks("policy.server")["policy.server"]
    assert found.status == "fail" and "/health does not answer 200" in found.summary


class _NoLora(BaseHTTPRequestHandler):
    """Answers like a vLLM started without LoRA and runtime loading: healthy, a base model, no load route."""

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "tiny"}]}).encode() if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_policy_without_lora_or_its_deployment_fails(home):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoLora)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _record(os.getpid(), f"http://127.0.0.1:{server.server_address[1]}", current="policy-r3-abc")
        found = run_checks("policy.model", "policy.lora")
    finally:
        server.shutdown()
    assert found["policy.server"].status == "ok"
    assert found["policy.model"].status == "fail" and "'policy-r3-abc' is not loaded" in found["policy.model"].summary
    assert "lcap deploy" in found["policy.model"].fix
    lora = found["policy.lora"]
    assert lora.status == "fail" and "started without --enable-lora" in lora.summary
    assert "runtime adapter loading is off" in lora.summary and "lcap serve --stop && lcap serve" in lora.fix


def _models_server(models: list[str], key: str | None = None) -> ThreadingHTTPServer:
    """A stand-in replica: healthy, lists `models`, has the LoRA load route; with `key`, answers 401 without it."""

    class Handler(_NoLora):
        def do_GET(self) -> None:
            if key and self.path != "/health" and self.headers.get("authorization") != f"Bearer {key}":
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = json.dumps({"data": [{"id": m} for m in models]}).encode() if self.path == "/v1/models" else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            self.send_response(400)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_policy_checks_and_status_cover_every_replica(home):
    """Two stand-in replicas: the deployment missing on one is named; a dead one is named; a Ray replica (no local
    process, behind a key) is asked with the record's key."""
    from lcap.policy import PolicyServer, Replica, write_policy
    from lcap.serve.status import policy
    from lcap.status import View

    key_file = home / "policy.key"
    key_file.write_text("k-1\n")
    both, base_only = _models_server(["tiny", "lora-1"], key="k-1"), _models_server(["tiny"])
    url = [f"http://127.0.0.1:{s.server_address[1]}" for s in (both, base_only)]

    def record(r1_pid: int | None) -> None:
        replicas = [Replica("r0", url[0], None, actor="lcap-r0", node="10.0.0.2"), Replica("r1", url[1], r1_pid)]
        write_policy(PolicyServer(url[0], None, "/m", "tiny", "lora-1", "", "python", "2026-01-01T00:00:00",
                                  replicas=replicas, api_key_file=str(key_file)))  # fmt: skip

    try:
        record(os.getpid())
        found = run_checks("policy.model")
        assert found["policy.server"].status == "ok" and "2 replicas are healthy" in found["policy.server"].summary
        assert found["policy.model"].status == "fail"
        assert "'lora-1' is not loaded on replica r1" in found["policy.model"].summary
        section = policy(View(home / "none.duckdb", time.time()))
        assert [(row[0], row[2], row[3], row[6]) for row in section.rows] == [
            ("r0", "Ray 10.0.0.2", "healthy", "lora-1"),
            ("r1", str(os.getpid()), "healthy", "lora-1 (NOT loaded)"),
        ]
        assert section.data["replicas_healthy"] == 2

        dead = _dead_pid()
        record(dead)
        found = run_checks("policy.server")["policy.server"]
        assert found.status == "fail" and f"replica r1 (pid {dead}, {url[1]}) is not running" in found.summary
        assert found.fix.startswith("lcap serve --stop && lcap serve --model /m --name tiny --replicas 2 (its log")
        key_file.write_text("wrong\n")
        section = policy(View(home / "none.duckdb", time.time()))
        assert section.rows[0][3].startswith("not answering (HTTPStatusError") and "401" in section.rows[0][3]
        assert section.notes[0].startswith("r0: see")
    finally:
        both.shutdown()
        base_only.shutdown()


def test_store_checks(home, tmp_path, monkeypatch):
    from lcap import doctor_checks
    from lcap.store import Store

    db = tmp_path / "lcap.duckdb"
    assert run_checks("store", db=db)["store.open"].status == "skip"
    store = Store(db)
    store.append("episodes", [{"episode_id": "e", "status": "ok"}])
    found = run_checks("store", db=db)
    assert [found[n].status for n in ("store.open", "store.schema", "store.capture")] == ["ok", "ok", "ok"]
    assert "1 episodes, 0 turns" in found["store.open"].summary

    store.append("dead_letters", [{"record_id": "s/1/0", "stored_as": "none", "reason": "test"}])
    found = run_checks("store.capture", db=db)["store.capture"]
    assert found.status == "warn" and found.summary.startswith("1 dead letters")

    store.execute("UPDATE schema_version SET version = 99")
    found = run_checks("store.schema", db=db)["store.schema"]
    assert found.status == "fail" and found.fix.startswith("upgrade lcap")

    monkeypatch.setattr(doctor_checks, "STORE_TIMEOUT", 0.5)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb, time; c = duckdb.connect({str(db)!r}); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        found = run_checks("store.open", db=db)["store.open"]
    finally:
        holder.kill()
        holder.wait()
    assert found.status == "fail" and "locked by another process" in found.summary and "close it" in found.fix

    garbage = tmp_path / "garbage.duckdb"
    garbage.write_bytes(b"this is not a database" * 100)
    found = run_checks("store.open", db=garbage)["store.open"]
    assert found.status == "fail" and "cannot open store" in found.summary


def test_optional_tools_pass_where_installed_and_fail_without_them(tmp_path, monkeypatch):
    from lcap.capture import doctor as capture_doctor

    names = ("transparent.iptables", "transparent.netns", "ui.chromium", "sandbox.bubblewrap")
    here = run_checks(*names)
    if shutil.which("bwrap") and os.geteuid() == 0:
        assert here["sandbox.bubblewrap"].status == "ok" and "bubblewrap" in here["sandbox.bubblewrap"].summary
    if capture_doctor._find("iptables"):
        assert here["transparent.iptables"].status == "ok" and "iptables v" in here["transparent.iptables"].summary
    if capture_doctor._find("unshare") and os.geteuid() == 0:
        assert here["transparent.netns"].status == "ok"
    if shutil.which("chromium"):
        assert here["ui.chromium"].status == "ok" and "Chromium" in here["ui.chromium"].summary
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(capture_doctor, "SBIN", ())
    bare = run_checks(*names)
    assert all(bare[n].status == "fail" for n in names), bare
    assert bare["transparent.iptables"].fix == "apt-get install iptables"
    assert "chromium" in bare["ui.chromium"].fix
    assert bare["sandbox.bubblewrap"].fix == "apt-get install bubblewrap"


def test_doctor_cli_exit_codes_and_json(home, tmp_path):
    env = {**os.environ}
    ok = subprocess.run([LCAP, "doctor", "--json", "ca", "store"], env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] is True and [c["name"] for c in report["checks"]] == [
        "ca",
        "ca.key",
        "ca.bundle",
        "store.open",
        "store.schema",
        "store.capture",
    ]
    (home / "ca" / "bundle.pem").write_text("broken")
    bad = subprocess.run([LCAP, "doctor", "ca.bundle"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "FAIL  ca.bundle" in bad.stdout and f"fix: rm {home / 'ca' / 'bundle.pem'}" in bad.stdout
    assert "1 required check failed: ca.bundle" in bad.stdout
    unknown = subprocess.run([LCAP, "doctor", "nope"], env=env, capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and unknown.stderr.startswith("lcap: no check named nope: the checks are ca, ")
