"""`lcap doctor`: every check passing and failing, each failure with its fix (applied where the test can, to see
it work). Real parts: lcap's CA and bundle, Python/curl/Node/Java clients against a local TLS server, the Node
preload, spools with sealed records, a throwaway proxy, DuckDB stores (one locked by another process), the vLLM
CPU server (marked vllm). A stand-in HTTP server plays a vLLM started without LoRA (starting a second real one
costs minutes here), and a throwaway package plays an installed Ray."""

from __future__ import annotations

import pytest
from fixtures_doctor import run_checks


@pytest.mark.vllm
def test_policy_checks_pass_on_the_real_server(vllm_policy, monkeypatch, tmp_path):
    monkeypatch.setenv("LCAP_HOME", str(vllm_policy.lcap_home))
    found = run_checks("policy")
    assert {n: r.status for n, r in found.items()} == dict.fromkeys(
        ("policy.server", "policy.model", "policy.lora"), "ok"
    )
    assert "current deployment 'tiny' (the base model)" in found["policy.model"].summary
    from lcap.policy import read_policy, write_policy

    record = read_policy()
    assert record is not None
    record.current = "policy-r9-gone"
    write_policy(record)  # vllm_policy puts the base back afterwards
    assert run_checks("policy.model")["policy.model"].status == "fail"
