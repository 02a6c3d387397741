"""`lcap doctor`: every check passing and failing, each failure with its fix (applied where the test can, to see
it work). Real parts: lcap's CA and bundle, Python/curl/Node/Java clients against a local TLS server, the Node
preload, spools with sealed records, a throwaway proxy, DuckDB stores (one locked by another process), the vLLM
CPU server (marked vllm). A stand-in HTTP server plays a vLLM started without LoRA (starting a second real one
costs minutes here), and a throwaway package plays an installed Ray."""

from __future__ import annotations

import importlib
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

from lcap import doctor as registry
from lcap.cli import DOCTOR_CHECKS
from lcap.doctor import Result

LCAP = str(Path(sys.executable).parent / "lcap")
for _module in DOCTOR_CHECKS:
    importlib.import_module(_module)


def run(*names: str, db: Path | None = None) -> dict[str, Result]:
    """The named checks (and those they need), as `lcap doctor NAMES` runs them."""
    with registry.context(db or Path("no-store.duckdb")) as ctx:
        return {c.name: r for c, r in registry.run_checks(ctx, registry.selected(names))}


@pytest.fixture(scope="module")
def made_ca(tmp_path_factory) -> Path:
    """lcap's CA, made once for the module (an RSA key takes a while); each test copies it."""
    from lcap.capture.proxy.server import ensure_ca

    home = tmp_path_factory.mktemp("doctor-ca-home")
    saved = os.environ.get("LCAP_HOME")
    os.environ["LCAP_HOME"] = str(home)
    try:
        ensure_ca()
    finally:
        if saved is None:
            os.environ.pop("LCAP_HOME")
        else:
            os.environ["LCAP_HOME"] = saved
    return home / "ca"


@pytest.fixture
def home(made_ca, tmp_path, monkeypatch) -> Path:
    path = tmp_path / "home"
    shutil.copytree(made_ca, path / "ca")
    monkeypatch.setenv("LCAP_HOME", str(path))
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(path / "policy.json"))
    return path


# --- the registry --------------------------------------------------------------------------------


def test_registry_skips_what_a_failed_check_needs_and_bounds_every_check(monkeypatch):
    calls = []

    def hangs(ctx):
        time.sleep(30)
        return Result.ok("never")

    def raises(ctx):
        raise RuntimeError("oops")

    checks = [
        registry.Check("t.broken", "store", True, raises),
        registry.Check("t.after", "store", True, lambda ctx: calls.append(1) or Result.ok("ran"), needs=("t.broken",)),
        registry.Check("t.hangs", "optional", False, hangs, timeout=0.3),
    ]
    monkeypatch.setattr(registry, "CHECKS", checks)
    assert [c.name for c in registry.selected(["t.after"])] == ["t.broken", "t.after"]  # with what it needs
    with registry.context(Path("x")) as ctx:
        results = registry.run_checks(ctx, checks)
    found = {c.name: r for c, r in results}
    assert found["t.broken"].status == "fail" and "RuntimeError: oops" in found["t.broken"].summary
    assert found["t.after"].status == "skip" and found["t.after"].summary == "needs t.broken" and not calls
    assert found["t.hangs"].status == "fail" and found["t.hangs"].summary == "no answer within 0.3 s"
    assert registry.exit_code(results) == 1
    assert registry.exit_code(results[2:]) == 0  # an optional check failing never fails the run
    assert registry.verdict(results).startswith("1 required check failed: t.broken; optional parts missing: t.hangs")


# --- lcap's CA, its bundle, and the clients that trust it ----------------------------------------


def test_ca_is_made_on_a_fresh_home_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "fresh"))
    found = run("ca.key", "ca.bundle")
    assert found["ca"].status == "ok" and "made now" in found["ca"].summary
    assert found["ca.key"].status == "ok"
    assert found["ca.bundle"].status == "ok" and found["ca.bundle"].details["roots"] > 0


def test_damaged_ca_certificate_fails_and_its_dependents_are_skipped(home):
    (home / "ca" / "mitmproxy-ca-cert.pem").write_text("not a certificate\n")
    found = run("ca.bundle", "trust.python")
    assert found["ca"].status == "fail" and "cannot read lcap's CA certificate" in found["ca"].summary
    assert f"move {home / 'ca'} away" in found["ca"].fix
    assert found["ca.bundle"].status == found["trust.python"].status == "skip"


def test_ca_key_readable_by_others_fails_until_the_fix(home):
    key = home / "ca" / "mitmproxy-ca.pem"
    key.chmod(0o644)
    found = run("ca.key")["ca.key"]
    assert found.status == "fail" and "mode 0644" in found.summary
    assert f"chmod 600 {key}" in found.fix
    key.chmod(0o600)
    assert run("ca.key")["ca.key"].status == "ok"


TRUST = ("ca.bundle", "trust.python", "trust.curl", "trust.node", "roundtrip")


def test_broken_bundle_fails_trust_and_the_round_trip_until_removed(home):
    """A bundle that is no bundle (newer than the CA, so lcap keeps giving it to children): the bundle check, every
    client and the live round trip fail; the fix (remove it: lcap writes it again) makes them pass."""
    if shutil.which("curl") is None or shutil.which("node") is None:
        pytest.skip("curl and node are needed")
    run("ca.bundle")
    bundle = home / "ca" / "bundle.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    broken = run(*TRUST)
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
    fixed = run(*TRUST)
    assert {name: r.status for name, r in fixed.items()} == dict.fromkeys(("ca", *TRUST), "ok"), fixed
    assert set(fixed["trust.python"].details["clients"]) >= {"urllib", "httpx"}
    assert "answered, stored, read back" in fixed["roundtrip"].summary


def test_bundle_without_lcaps_ca_fails(home):
    import ssl

    roots = ssl.get_default_verify_paths().openssl_cafile
    if not roots or not os.path.isfile(roots):
        pytest.skip("no system roots file")
    run("ca.bundle")
    shutil.copyfile(roots, home / "ca" / "bundle.pem")
    found = run("ca.bundle")["ca.bundle"]
    assert found.status == "fail" and "lacks lcap's CA" in found.summary


@pytest.mark.skipif(shutil.which("java") is None, reason="needs a JDK")
def test_java_trusts_lcaps_store_and_fails_with_a_broken_one(home, monkeypatch):
    """lcap gives a JVM child its trust store in JAVA_TOOL_OPTIONS (after the user's own options); a store Java
    cannot read fails, and removing it (as the fix says) makes lcap write it again."""
    from lcap.capture.reach.jvm import TRUST_STORE

    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Xss2m")
    assert run("trust.java")["trust.java"].status == "ok"
    store = home / "ca" / TRUST_STORE
    store.write_bytes(b"not a key store")
    found = run("trust.java")["trust.java"]
    assert found.status == "fail" and str(store) in found.fix, found
    store.unlink()
    assert run("trust.java")["trust.java"].status == "ok"


def test_node_preload_passes_installed_and_fails_without_its_packages(home, node_modules, monkeypatch, tmp_path):
    from fixtures_capture import node_cache_dir

    monkeypatch.setenv("LCAP_NODE_DIR", str(node_cache_dir()))
    assert run("node.preload")["node.preload"].status == "ok"
    monkeypatch.setenv("LCAP_NODE_DIR", str(tmp_path / "empty"))
    found = run("node.preload")["node.preload"]
    assert found.status == "fail" and "undici missing (wants 6.21.3)" in found.summary
    assert found.fix.startswith("lcap setup node")


# --- the spool -----------------------------------------------------------------------------------------


def test_spool_key(home):
    from lcap.capture.storage.spool import spool_key

    assert run("spool.key")["spool.key"].status == "skip"
    spool_key(home / "spool")
    assert run("spool.key")["spool.key"].status == "ok"
    key = home / "spool" / "key"
    key.chmod(0o644)
    assert run("spool.key")["spool.key"].status == "fail"
    key.chmod(0o600)
    key.write_bytes(b"short")
    found = run("spool.key")["spool.key"]
    assert found.status == "fail" and "damaged (5 bytes, not 32)" in found.summary


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _spool(home: Path, owner: int, db: Path, n: int) -> Path:
    from lcap.capture.storage.spool import SpoolAppender
    from lcap.capture.turns.turn import PendingTurn

    appender = SpoolAppender(home / "spool" / f"{owner}-0badf00d", db)
    for i in range(n):
        turn = PendingTurn(episode_id="ep", seq=i, host="api.openai.com", path="/v1/chat/completions", dialect="chat")
        turn.request_body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}).encode()
        turn.response_body = json.dumps({"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}]}).encode()
        turn.status_code, turn.started_at, turn.t0 = 200, time.time(), time.perf_counter()
        turn.t_end = turn.t0
        appender.append(turn)
    appender.close()
    return appender.directory


def test_full_spool_of_an_ended_proxy_fails_and_its_fix_stores_the_turns(home, tmp_path):
    from lcap.store import Store

    db = tmp_path / "lcap.duckdb"
    Store(db).execute("SELECT 1")
    directory = _spool(home, _dead_pid(), db, 5)
    found = run("spool.backlog")["spool.backlog"]
    assert found.status == "fail", found
    assert "5 turns" in found.summary and f"wait in {directory}" in found.summary
    fix = f"lcap proxy --db {db.resolve()} -- true"
    assert fix in found.fix
    done = subprocess.run([LCAP, *shlex.split(fix)[1:]], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert run("spool.backlog")["spool.backlog"].status == "ok"
    assert Store(db).fetchall("SELECT count(*) FROM turns WHERE episode_id = 'ep'") == [(5,)]


def test_spool_of_a_live_proxy_far_behind_fails(home, tmp_path, monkeypatch):
    from lcap.capture import doctor as capture_doctor

    _spool(home, os.getpid(), tmp_path / "lcap.duckdb", 3)
    assert run("spool.backlog")["spool.backlog"].status == "ok"  # a writer at work, not behind
    monkeypatch.setattr(capture_doctor, "BACKLOG_RECORDS", 2)
    found = run("spool.backlog")["spool.backlog"]
    assert found.status == "fail" and f"the writer of proxy {os.getpid()} is 3 turns" in found.summary
    assert "`lcap status` shows the writer" in found.fix


def test_spool_disk_nearly_full_fails(home, monkeypatch):
    from lcap.capture import doctor as capture_doctor

    monkeypatch.setattr(capture_doctor, "MIN_FREE_BYTES", 1 << 62)
    found = run("spool.backlog")["spool.backlog"]
    assert found.status == "fail" and "free on the spool's disk" in found.summary


# --- vLLM and the policy server ------------------------------------------------------------------------


def test_vllm_missing_fails_and_lcaps_venv_passes(home, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    found = run("vllm")["vllm"]
    assert found.status == "fail" and found.fix == "lcap setup vllm"
    real = Path.home() / ".lcap" / "vllm-venv"
    if not (real / "bin" / "python").exists():
        pytest.skip("no vLLM venv on this machine")
    (home / "vllm-venv").symlink_to(real, target_is_directory=True)
    found = run("vllm")["vllm"]
    assert found.status == "ok" and "vllm" in found.summary


def _record(pid: int, url: str, current: str = "tiny") -> None:
    from lcap.policy import PolicyServer, write_policy

    write_policy(
        PolicyServer(url, pid, "/models/tiny", "tiny", current, "/tmp/vllm.log", "python", "2026-01-01T00:00:00")
    )


def test_stopped_policy_server_fails_with_the_restart(home):
    assert run("policy.server")["policy.server"].status == "skip"  # nothing recorded: nothing to check
    _record(_dead_pid(), "http://127.0.0.1:9")
    found = run("policy.lora", "policy.model")
    assert found["policy.server"].status == "fail" and "is not running" in found["policy.server"].summary
    assert found["policy.server"].fix.startswith("lcap serve --stop && lcap serve --model /models/tiny")
    assert found["policy.model"].status == found["policy.lora"].status == "skip"

    _record(os.getpid(), "http://127.0.0.1:9")  # a live process, but nothing answers
    found = run("policy.server")["policy.server"]
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
        found = run("policy.model", "policy.lora")
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
        found = run("policy.model")
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
        found = run("policy.server")["policy.server"]
        assert found.status == "fail" and f"replica r1 (pid {dead}, {url[1]}) is not running" in found.summary
        assert found.fix.startswith("lcap serve --stop && lcap serve --model /m --name tiny --replicas 2 (its log")
        key_file.write_text("wrong\n")
        section = policy(View(home / "none.duckdb", time.time()))
        assert section.rows[0][3].startswith("not answering (HTTPStatusError") and "401" in section.rows[0][3]
        assert section.notes[0].startswith("r0: see")
    finally:
        both.shutdown()
        base_only.shutdown()


def test_the_restart_keeps_the_replicas_the_cluster_and_the_vllm_arguments():
    """The fix that restarts the policy server starts it as it was: `--replicas`, `--ray`, and the rest."""
    from lcap.policy import PolicyServer, Replica
    from lcap.serve.doctor import restart_command

    replicas = [Replica(f"r{i}", f"http://10.0.0.{i + 2}:8000", None, actor=f"a{i}") for i in range(2)]
    record = PolicyServer(
        replicas[0].url, None, "Qwen/Qwen3-8B", "Qwen3-8B", "Qwen3-8B", "", "/opt/vllm env/bin/python", "2026-01-01",
        replicas=replicas, ray_address="10.0.0.1:6379", tool_parser=None, vllm_args=["--tensor-parallel-size", "2"],
    )  # fmt: skip
    assert restart_command(record) == (
        "lcap serve --stop && lcap serve --model Qwen/Qwen3-8B --replicas 2 --ray 10.0.0.1:6379 "
        "--python '/opt/vllm env/bin/python' --tool-parser none -- --tensor-parallel-size 2"
    )


@pytest.mark.vllm
def test_policy_checks_pass_on_the_real_server(vllm_policy, monkeypatch, tmp_path):
    monkeypatch.setenv("LCAP_HOME", str(vllm_policy.lcap_home))
    found = run("policy")
    assert {n: r.status for n, r in found.items()} == dict.fromkeys(
        ("policy.server", "policy.model", "policy.lora"), "ok"
    )
    assert "current deployment 'tiny' (the base model)" in found["policy.model"].summary
    from lcap.policy import read_policy, write_policy

    record = read_policy()
    assert record is not None
    record.current = "policy-r9-gone"
    write_policy(record)  # vllm_policy puts the base back afterwards
    assert run("policy.model")["policy.model"].status == "fail"


# --- the store -----------------------------------------------------------------------------------------


def test_store_checks(home, tmp_path, monkeypatch):
    from lcap import doctor_checks
    from lcap.store import Store

    db = tmp_path / "lcap.duckdb"
    assert run("store", db=db)["store.open"].status == "skip"
    store = Store(db)
    store.append("episodes", [{"episode_id": "e", "status": "ok"}])
    found = run("store", db=db)
    assert [found[n].status for n in ("store.open", "store.schema", "store.capture")] == ["ok", "ok", "ok"]
    assert "1 episodes, 0 turns" in found["store.open"].summary

    store.append("dead_letters", [{"record_id": "s/1/0", "stored_as": "none", "reason": "test"}])
    found = run("store.capture", db=db)["store.capture"]
    assert found.status == "warn" and found.summary.startswith("1 dead letters")

    store.execute("UPDATE schema_version SET version = 99")
    found = run("store.schema", db=db)["store.schema"]
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
        found = run("store.open", db=db)["store.open"]
    finally:
        holder.kill()
        holder.wait()
    assert found.status == "fail" and "locked by another process" in found.summary and "close it" in found.fix

    garbage = tmp_path / "garbage.duckdb"
    garbage.write_bytes(b"this is not a database" * 100)
    found = run("store.open", db=garbage)["store.open"]
    assert found.status == "fail" and "cannot open store" in found.summary


# --- optional parts --------------------------------------------------------------------------------


def test_ray_check_follows_what_is_importable(tmp_path, monkeypatch):
    import importlib.util

    installed = importlib.util.find_spec("ray") is not None
    assert run("ray")["ray"].status == ("ok" if installed else "fail")
    if not installed:
        package = tmp_path / "site"
        (package / "ray").mkdir(parents=True)
        (package / "ray" / "__init__.py").write_text("")
        (package / "ray-9.9.9.dist-info").mkdir()
        (package / "ray-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ray\nVersion: 9.9.9\n")
        monkeypatch.syspath_prepend(str(package))
        importlib.invalidate_caches()
        found = run("ray")["ray"]
        assert found.status == "ok" and found.summary == "Ray 9.9.9"


def test_optional_tools_pass_where_installed_and_fail_without_them(tmp_path, monkeypatch):
    from lcap.capture import doctor as capture_doctor

    names = ("transparent.iptables", "transparent.netns", "ui.chromium")
    here = run(*names)
    if capture_doctor._find("iptables"):
        assert here["transparent.iptables"].status == "ok" and "iptables v" in here["transparent.iptables"].summary
    if capture_doctor._find("unshare") and os.geteuid() == 0:
        assert here["transparent.netns"].status == "ok"
    if shutil.which("chromium"):
        assert here["ui.chromium"].status == "ok" and "Chromium" in here["ui.chromium"].summary
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(capture_doctor, "SBIN", ())
    bare = run(*names)
    assert all(bare[n].status == "fail" for n in names), bare
    assert bare["transparent.iptables"].fix == "apt-get install iptables"
    assert "chromium" in bare["ui.chromium"].fix


# --- the command ---------------------------------------------------------------------------------------


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
