"""Secrets never reach disk: every common key format is redacted before the store, the spool on disk is sealed,
and the store, its WAL, the spool and its key are private to their owner.

The formats are checked with a maintained detector as the oracle: Yelp's detect-secrets (its regex plugins)
finds each sample it knows in the text as the agent sent it, and nothing in what lcap stores.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from fixtures_capture import LCAP, agent, is_private, store_text, turns

from lcap.redact import REDACTED, redact_keys, redact_text

# One sample per format, as it would sit in an agent's context (an env dump, a config file, a tool's output).
SAMPLES = {
    "openai": "sk-proj-Ab3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5zA7bC9dE1fG3",
    "anthropic": "sk-ant-api03-Zx8Yw7Vu6Ts5Rq4Po3Nm2Lk1Jh0Gf9Ed8Cb7Az6Yx5Wv4Ut3Sr2Qp1On0Ml9Kj8Ih7Gf6Ed5Cb4Az3-AbCdEfAA",
    "huggingface": "hf_QpWoEiRuTyAlSkDjFhGzXmCnVb1234567890",
    "aws_key_id": "AKIAQ3EGRWT5JKUZXN4M",
    "aws_session_key_id": "ASIAY34FZKBOKMUTVV7A",
    "aws_secret": 'aws_secret_access_key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKE"',
    "github_classic": "ghp_R4nd0mT0k3nV4lu3F0rT3st1ngPurp0s3s00",
    "github_oauth": "gho_16C7e42F292c6912E7710c838347Ae178B4a",
    "github_fine_grained": "github_pat_11ABCDEFG0aBcDeFgHiJkL_mNoPqRsTuVwXyZ0123456789aBcDeFgHiJkLmNoPqRsTuVwXyZ012345",
    "gitlab": "glpat-xR7bK2mN9pQ4sT6vW8yZ",
    "slack": "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    "google": "AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY",
    "stripe": "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
    "jwt": "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ."
    "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
    "private_key": "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi\nZ1BjP5CE/Wm/Rr500P\n"
    "-----END RSA PRIVATE KEY-----",
    "sendgrid": "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",
    "npm": "npm_abcdefghijklmnopqrstuvwxyz0123456789",
    "url_password": "https://deploy:S3cr3tPassw0rd9@git.example.com/repo.git",
}


# What must not survive: the sample itself, or its secret part where the sample carries a name or a URL around it.
SECRETS = {
    **SAMPLES,
    "aws_secret": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKE",
    "private_key": "MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi",
    "url_password": "S3cr3tPassw0rd9",
}


def _detect(line: str) -> set[str]:
    """The kinds of secret detect-secrets' regex plugins find in `line`."""
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
    from detect_secrets.plugins.base import RegexBasedDetector
    from detect_secrets.settings import default_settings

    found = set()
    with default_settings():
        for kind, plugin in get_mapping_from_secret_type_to_class().items():
            regex = issubclass(plugin, RegexBasedDetector) and kind != "Public IP (ipv4)"
            if regex and plugin().analyze_line(filename="agent.txt", line=line):
                found.add(kind)
    return found


def test_every_key_format_is_redacted_and_the_maintained_detector_agrees():
    missed = {kind: sample for kind, sample in SAMPLES.items() if SECRETS[kind] in (redact_keys(sample) or "")}
    assert not missed, missed
    known = 0
    for kind, sample in SAMPLES.items():
        for line in (sample, json.dumps({"content": f"my {kind} is {sample} ok"})):  # as is, and inside JSON text
            before, after = _detect(line), _detect(redact_keys(line) or "")
            assert not after, f"{kind}: detect-secrets still finds {after} in {redact_keys(line)!r}"
            known += bool(before)
    assert known >= 20  # the oracle knows most of these formats, so its silence after redaction means something
    # Text that only looks close is left alone: a redaction rule that is too wide would rewrite prompts.
    prose = "risk-free-2024-strategy-and-planning, task-manager-v2-release-candidate, AKIA is a prefix, Bearer of news"
    assert redact_keys(prose) == prose
    assert redact_text("curl -H 'x-api-key: abcdef123456' https://u:p4ssw0rd@h/x") == (
        f"curl -H 'x-api-key: {REDACTED}' https://u:{REDACTED}@h/x"
    )


def test_no_secret_reaches_the_spool_or_the_store(capture_env, llm, capture_home):
    """An agent sends every format in its prompt and two in the query. While another process holds the store,
    its turn waits in the spool: the spool files hold none of them; once stored, neither does the DuckDB file.
    The store, the spool directory, its files and its key are private."""
    db, release = Path(capture_env["LCAP_DB"]), capture_home.parent / f"release-{os.getpid()}-{time.time()}"
    env = {**capture_env, "LCAP_TEST_SECRETS": json.dumps(SAMPLES), "LCAP_TEST_RELEASE": str(release)}
    proxy = subprocess.Popen(
        [LCAP, "proxy", "--upstream", llm.url, "--", *agent("raw_agent.py"), "hold_store", "secrets"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    spool_root = capture_home / "spool"
    deadline = time.monotonic() + 60
    segments: list[Path] = []
    while time.monotonic() < deadline and not segments:
        segments = [p for p in spool_root.glob(f"{proxy.pid}-*/*.turns") if p.stat().st_size]
        time.sleep(0.05)
    assert segments, "the turn never reached the spool"
    spooled = b"".join(p.read_bytes() for p in segments)
    for kind, secret in SECRETS.items():
        assert secret.encode() not in spooled, f"{kind} is in the spool in plain text"
    spool = segments[0].parent
    assert is_private(spool_root) and is_private(spool) and is_private(spool_root / "key")
    assert all(is_private(p) for p in spool.iterdir())
    release.touch()  # the store is free: the waiting turn is stored
    out, err = proxy.communicate(timeout=180)
    assert proxy.returncode == 0, err
    assert out.splitlines() == ["HTTP/1.1 200 OK"]
    (row,) = turns(db)
    assert "Here is my environment" in row["request"]["messages"][0]["content"]
    text = store_text(db)
    for kind, secret in SECRETS.items():
        assert secret not in text, f"{kind} reached the store"
    assert row["path"] == f"/v1/chat/completions?key={REDACTED}&trace={REDACTED}"
    assert is_private(db)
