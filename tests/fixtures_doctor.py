"""`lcap doctor`'s checks as the tests run them, and an lcap home with a CA made once per module."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from lcap import doctor as registry
from lcap.cli import DOCTOR_CHECKS
from lcap.doctor import Result

for _module in DOCTOR_CHECKS:
    importlib.import_module(_module)


def run_checks(*names: str, db: Path | None = None) -> dict[str, Result]:
    """The named checks (and those they need), as `lcap doctor NAMES` runs them."""
    with registry.context(db or Path("no-store.duckdb")) as ctx:
        return {c.name: r for c, r in registry.run_checks(ctx, registry.selected(names))}


@pytest.fixture(scope="module")
def made_ca(tmp_path_factory) -> Path:
    """lcap's CA, made once for the module (an RSA key takes a while); each test copies it."""
    from lcap.capture.trust.ca import ensure_ca

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


def sealed_spool(home: Path, owner: int, db: Path, n: int) -> Path:
    """A spool of N sealed chat turns left by process OWNER for the store DB, under HOME."""
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
