"""`lcap ui` over real DuckDB stores: the app in-process (Starlette's test client) and `lcap ui` as a child
process (CLI, token, read-only while a writer writes). The browser tests are in test_ui_browser.py."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time

import httpx
from fixtures_ui import LCAP, UiServer

from lcap.store import Store
from lcap.ui.options import UiOptions


def test_no_store_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run(
        [LCAP, "ui", "--db", str(tmp_path / "none.duckdb")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no store at" in done.stderr
    bad = subprocess.run([LCAP, "ui", "--db", str(tmp_path / "x"), "--poll", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--poll 0.0: use 0.2 to 60 seconds" in bad.stderr


def test_beyond_loopback_every_request_needs_the_printed_token(ui_db):
    server = UiServer(ui_db, host="0.0.0.0")
    try:
        token = re.search(r"\?token=([\w-]+)", server.first_line).group(1)
        base = f"http://127.0.0.1:{server.port}"
        assert httpx.get(f"{base}/episodes").status_code == 401
        assert httpx.get(f"{base}/episodes?token=wrong").status_code == 401
        assert httpx.get(f"{base}/static/app.css").status_code == 401
        entry = httpx.get(f"{base}/episodes?token={token}&round=1")
        assert entry.status_code == 303 and entry.headers["location"] == "/episodes?round=1"  # token leaves the URL
        cookie = entry.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        with httpx.Client(base_url=base, cookies={"lcap_ui_token": token}) as c:
            assert c.get("/episodes").status_code == 200
        assert httpx.get(f"{base}/", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    finally:
        rest = server.stop()
    assert (server.first_line + rest).count(token) == 1  # printed once


def test_the_ui_never_writes_and_serves_while_a_writer_writes(ui_db, tmp_path):
    """A writer appends turns in batches (attach, write, detach) while pages are read: both succeed, and
    browsing alone leaves the file byte for byte as it was."""
    db = tmp_path / "live.duckdb"
    db.write_bytes(ui_db.read_bytes())
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    server = UiServer(db)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for path in (
                "/",
                "/episodes",
                "/episode?id=ep-calc-0",
                "/group?round=1&split=train&task=calc-1",
                "/raw?turn=ep-calc-0/t0&part=response",
            ):
                assert c.get(path).status_code == 200
            assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
            writer = subprocess.Popen(
                [sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            statuses = []
            while writer.poll() is None:
                statuses.append(c.get("/episodes", params={"q": "live"}).status_code)
            out, err = writer.communicate()
            assert writer.returncode == 0, err
            assert out.strip() == "40 batches"
            assert statuses and set(statuses) == {200}
            listed = c.get("/episodes", params={"q": "live"}).text
            assert "1 episode match" in listed and ">40<" in listed  # 40 calls of the live episode
    finally:
        server.stop()


WRITER = """
import sys, time
from lcap.store import Store
store = Store(sys.argv[1])
store.start_episode("ep-live", command="agent", cwd="/", labels={"task": "live", "round": "3"})
for n in range(40):
    store.append("turns", [{"turn_id": f"live-{n}", "episode_id": "ep-live", "seq": n, "dialect": "chat"}])
    time.sleep(0.02)
print("40 batches")
"""


def test_live_events_announce_new_rows(ui_db, tmp_path):
    db = tmp_path / "events.duckdb"
    db.write_bytes(ui_db.read_bytes())
    server = UiServer(db)
    try:
        seen = []
        with httpx.stream("GET", f"{server.url}/events", timeout=30) as stream:
            lines = stream.iter_lines()
            started = time.monotonic()
            for line in lines:
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if len(seen) == 1:
                        Store(db).append("turns", [{"turn_id": "new", "episode_id": "ep-calc-0", "seq": 9}])
                    else:
                        break
                assert time.monotonic() - started < 20
        assert seen[1][2] == seen[0][2] + 1  # the turn count moved by the one appended
    finally:
        server.stop()


def test_live_streams_are_bounded(ui_db):
    """Past the limit of open live pages a new one is refused (it retries later); a closed one frees its place."""
    import threading

    import uvicorn

    from lcap.ui.app import create_app

    app = create_app(ui_db, UiOptions(poll=0.2), token=None, max_listeners=2)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/events"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        with httpx.Client(timeout=10) as c:
            with c.stream("GET", url) as one, c.stream("GET", url) as two:
                assert one.status_code == two.status_code == 200
                third = c.get(url)
                assert third.status_code == 503 and third.headers["retry-after"] == "5"
            deadline = time.monotonic() + 10
            while True:  # the server notices the closed streams at its next poll
                with c.stream("GET", url) as again:
                    if again.status_code == 200:
                        break
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
