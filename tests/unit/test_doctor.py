"""`lcap doctor`'s registry and the checks that run in-process: the CA, the spool, the vLLM venv, the restart
command, Ray (checks on clients, proxies and servers: tests/integration/test_doctor.py; on the vLLM server:
tests/e2e/test_doctor.py)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from fixtures_doctor import run_checks, sealed_spool

from lcap import doctor as registry
from lcap.doctor import Result


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


def test_an_optional_part_fails_the_exit_code_only_when_named():
    def fails(ctx):
        return Result.fail("missing", "install it")

    required = registry.Check("store.open", "store", True, fails)
    optional = registry.Check("transparent.iptables", "optional", False, fails)
    ok = Result.ok("fine")
    missing = Result.fail("missing", "install it")
    assert registry.exit_code([(required, ok), (optional, missing)]) == 0  # reported, not failed
    assert registry.exit_code([(required, ok), (optional, missing)], ["transparent.iptables"]) == 1
    assert registry.exit_code([(required, ok), (optional, missing)], ["transparent"]) == 1  # its section
    assert registry.exit_code([(required, ok), (optional, missing)], ["trans"]) == 0  # not a name
    assert registry.exit_code([(required, missing), (optional, ok)]) == 1


def test_ca_is_made_on_a_fresh_home_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "fresh"))
    found = run_checks("ca.key", "ca.bundle")
    assert found["ca"].status == "ok" and "made now" in found["ca"].summary
    assert found["ca.key"].status == "ok"
    assert found["ca.bundle"].status == "ok" and found["ca.bundle"].details["roots"] > 0


def test_damaged_ca_certificate_fails_and_its_dependents_are_skipped(home):
    (home / "ca" / "mitmproxy-ca-cert.pem").write_text("not a certificate\n")
    found = run_checks("ca.bundle", "trust.python")
    assert found["ca"].status == "fail" and "cannot read lcap's CA certificate" in found["ca"].summary
    assert f"move {home / 'ca'} away" in found["ca"].fix
    assert found["ca.bundle"].status == found["trust.python"].status == "skip"


def test_ca_key_readable_by_others_fails_until_the_fix(home):
    key = home / "ca" / "mitmproxy-ca.pem"
    key.chmod(0o644)
    found = run_checks("ca.key")["ca.key"]
    assert found.status == "fail" and "mode 0644" in found.summary
    assert f"chmod 600 {key}" in found.fix
    key.chmod(0o600)
    assert run_checks("ca.key")["ca.key"].status == "ok"


def test_bundle_without_lcaps_ca_fails(home):
    import ssl

    roots = ssl.get_default_verify_paths().openssl_cafile
    if not roots or not os.path.isfile(roots):
        pytest.skip("no system roots file")
    run_checks("ca.bundle")
    shutil.copyfile(roots, home / "ca" / "bundle.pem")
    found = run_checks("ca.bundle")["ca.bundle"]
    assert found.status == "fail" and "lacks lcap's CA" in found.summary


def test_spool_key(home):
    from lcap.capture.storage.spool import spool_key

    assert run_checks("spool.key")["spool.key"].status == "skip"
    spool_key(home / "spool")
    assert run_checks("spool.key")["spool.key"].status == "ok"
    key = home / "spool" / "key"
    key.chmod(0o644)
    assert run_checks("spool.key")["spool.key"].status == "fail"
    key.chmod(0o600)
    key.write_bytes(b"short")
    found = run_checks("spool.key")["spool.key"]
    assert found.status == "fail" and "damaged (5 bytes, not 32)" in found.summary


def test_spool_of_a_live_proxy_far_behind_fails(home, tmp_path, monkeypatch):
    from lcap.capture import doctor as capture_doctor

    sealed_spool(home, os.getpid(), tmp_path / "lcap.duckdb", 3)
    assert run_checks("spool.backlog")["spool.backlog"].status == "ok"  # a writer at work, not behind
    monkeypatch.setattr(capture_doctor, "BACKLOG_RECORDS", 2)
    found = run_checks("spool.backlog")["spool.backlog"]
    assert found.status == "fail" and f"the writer of proxy {os.getpid()} is 3 turns" in found.summary
    assert "`lcap status` shows the writer" in found.fix


def test_spool_disk_nearly_full_warns(home, monkeypatch):
    from lcap.capture.storage import spool

    monkeypatch.setattr(spool, "SPOOL_MIN_FREE_BYTES", 0)
    monkeypatch.setattr(spool, "SPOOL_MIN_FREE_FRACTION", 0.0)
    assert run_checks("spool.disk")["spool.disk"].status == "ok"
    monkeypatch.setattr(spool, "SPOOL_MIN_FREE_BYTES", 1 << 62)
    found = run_checks("spool.disk")["spool.disk"]
    assert found.status == "warn" and "the spool's disk" in found.summary and "nearly full" in found.summary
    assert "--max-spool-backlog" in found.fix


def test_vllm_missing_fails_and_lcaps_venv_passes(home, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    found = run_checks("vllm")["vllm"]
    assert found.status == "fail" and found.fix == "lcap setup vllm"
    real = Path.home() / ".lcap" / "vllm-venv"
    if not (real / "bin" / "python").exists():
        pytest.skip("no vLLM venv on this machine")
    (home / "vllm-venv").symlink_to(real, target_is_directory=True)
    found = run_checks("vllm")["vllm"]
    assert found.status == "ok" and "vllm" in found.summary


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


def test_ray_check_follows_what_is_importable(tmp_path, monkeypatch):
    import importlib.util

    installed = importlib.util.find_spec("ray") is not None
    assert run_checks("ray")["ray"].status == ("ok" if installed else "fail")
    if not installed:
        package = tmp_path / "site"
        (package / "ray").mkdir(parents=True)
        (package / "ray" / "__init__.py").write_text("")
        (package / "ray-9.9.9.dist-info").mkdir()
        (package / "ray-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ray\nVersion: 9.9.9\n")
        monkeypatch.syspath_prepend(str(package))
        importlib.invalidate_caches()
        found = run_checks("ray")["ray"]
        assert found.status == "ok" and found.summary == "Ray 9.9.9"
