"""Who may write into an episode, where a rerouted call may go, and what an exposed proxy may reach.

- Attribution cannot be spoofed: an episode is named only with its secret (an HMAC of its id under the
  running proxy's key); without one a call is refused (407), or in `--serve` on loopback placed by its session rules.
  The embedded mitmproxy's own port serves nobody but the front.
- Rerouting never leaks: with `--upstream`, every request on an LLM path goes there (or gets a 503), whatever
  its body, never to the host the agent named, with the agent's key.
- An exposed proxy (a non-loopback `--host`) wants credentials, says so, and does not connect to loopback,
  link-local or private addresses unless `--allow-private`.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import socket
import ssl
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime

import httpx
import pytest
from fixtures_capture import LCAP, SECRET, FakeLLM, raw_exchange, run_lcap, serve_proxy, turns

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.capture.trust.ca import ca_bundle
from lcap.capture.trust.credentials import EpisodeKeys
from lcap.policy import PolicyServer, write_policy

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
BODY = json.dumps(CHAT).encode()


@pytest.fixture
def upstream():
    server = FakeLLM()
    server.thread.start()
    yield server
    server.shutdown()


def raw(port: int, data: bytes, *, then: bytes = b"") -> bytes:
    """Everything the proxy answers `data` until it closes the connection (every request here asks it to)."""
    return raw_exchange(port, data, then=then)


def basic(user: str, password: str) -> bytes:
    return b"proxy-authorization: Basic " + base64.b64encode(f"{user}:{password}".encode()) + b"\r\n"


def post(url: str, fields: bytes = b"", body: bytes = BODY) -> bytes:
    return b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n%scontent-length: %d\r\n\r\n%s" % (
        url.encode(),
        fields,
        len(body),
        body,
    )


# --- attribution ---------------------------------------------------------------------------------


AGENT = textwrap.dedent(
    """
    import os, sys, time, pathlib, httpx
    out = pathlib.Path(sys.argv[1])
    out.with_suffix(".port").write_text(os.environ["LCAP_PROXY_URL"].rsplit(":", 1)[1])
    deadline = time.monotonic() + 60
    while not out.with_suffix(".go").exists():
        if time.monotonic() > deadline:
            sys.exit("never told to go")
        time.sleep(0.05)
    with httpx.Client(timeout=30) as client:  # the proxy and CA from the environment lcap gave
        for _ in range(2):
            client.post("https://api.openai.com/v1/chat/completions", json={"model": "m", "messages": []}).raise_for_status()
    out.write_text("done")
    """
)


def test_an_outside_process_cannot_write_into_another_episode(capture_env, llm, tmp_path):
    """`lcap proxy --episode victim -- AGENT`: while the agent runs, another process that found the proxy's port
    tries every way in: no credentials, the victim's name with a guessed or stale password, the episode header
    with no secret or with a secret of another proxy. Each gets a 407; the episode has the agent's calls only."""
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    marker = tmp_path / "agent.out"
    proc = subprocess.Popen(
        [LCAP, "proxy", "--episode", "victim", "--upstream", llm.url, "--", sys.executable, str(script), str(marker)],
        env=capture_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.with_suffix(".port").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        port = int(marker.with_suffix(".port").read_text())
        other = EpisodeKeys.new()  # a secret minted by some other proxy
        attempts = {
            "no credentials": b"",
            "a guessed password": basic("victim", "0" * 32),
            "the password lcap used to accept": basic("victim", "lcap"),
            "a secret of another proxy": basic("victim", other.secret("victim")),
            "the episode header alone": b"x-lcap-episode: victim\r\n",
            "the episode header with another proxy's secret": b"x-lcap-episode: "
            + other.pair("victim").encode()
            + b"\r\n",
        }
        for why, fields in attempts.items():
            answer = raw(port, post(llm.url, fields))
            assert answer.startswith(b"HTTP/1.1 407"), (why, answer[:100])
            assert b'proxy-authenticate: Basic realm="lcap"' in answer
            tunnel = raw(port, b"CONNECT api.openai.com:443 HTTP/1.1\r\nhost: api.openai.com:443\r\n%s\r\n" % fields)
            assert tunnel.startswith(b"HTTP/1.1 407"), (why, tunnel[:100])
        marker.with_suffix(".go").write_text("go")
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        marker.with_suffix(".go").write_text("go")  # the agent ends either way
        if proc.poll() is None:
            proc.kill()
    assert marker.read_text() == "done"
    rows = turns(capture_env["LCAP_DB"])
    assert [(r["episode_id"], r["seq"], r["error"]) for r in rows] == [("victim", 0, None), ("victim", 1, None)]
    assert len(llm.calls()) == 2


def test_mitmproxy_serves_only_the_front(store, llm):
    """mitmproxy listens on a loopback port: a client connecting there directly is cut off before it is read."""
    with CaptureProxy(store, ProxyOptions(require_credentials=False)) as proxy:
        mitm_port = proxy._master.addons.get("proxyserver").listen_addrs()[0][1]
        with socket.create_connection(("127.0.0.1", mitm_port), timeout=10) as direct:
            direct.sendall(b"GET %s/v1/models HTTP/1.1\r\nhost: x\r\n\r\n" % llm.url.encode())
            assert direct.recv(65536) == b""
        handed = raw(
            proxy.port, b"GET %s/v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % llm.url.encode()
        )
        assert proxy._master.addons.get("frontonly").refused == 1
    assert handed.startswith(b"HTTP/1.1 200") and b"fake-model" in handed
    assert [r["path"] for r in llm.requests] == ["/v1/models"]


def test_a_bare_lf_cannot_smuggle_an_episode_in_on_mitmproxy(store, llm):
    """After a side call the connection is mitmproxy's. A later request hiding `x-lcap-episode: victim` behind a bare
    LF names no episode: without its secret the header proves nothing, however it is parsed."""
    with CaptureProxy(store, ProxyOptions(require_credentials=False)) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(b"GET %s/v1/models HTTP/1.1\r\nhost: x\r\n\r\n" % llm.url.encode())
            time.sleep(0.5)
            sock.sendall(post(llm.url, b"x-a: 1\nx-lcap-episode: victim\r\n"))
            time.sleep(1)
        assert proxy.flush(timeout=10)
    assert all(r["episode_id"] != "victim" for r in turns(store.path))
    assert all("victim" not in json.dumps(c["headers"]).lower() for c in llm.requests)


def test_episode_new_needs_a_running_proxy(capture_env):
    result = run_lcap(["episode", "new"], capture_env)
    assert result.returncode == 2 and result.stderr.startswith("lcap: no lcap proxy of ") and result.stdout == ""


# --- rerouting never leaks -------------------------------------------------------------------------


def test_rerouting_never_sends_a_call_to_its_original_host(store, llm, upstream):
    """With `--upstream`, requests on LLM paths go to the upstream whatever their body (not JSON, not UTF-8, not a
    call's shape, compressed, chunked, on a connection mitmproxy already carries), without the agent's key."""
    key = b"authorization: Bearer " + SECRET.encode() + b"\r\n"
    origin = llm.url  # where the agent thinks it is calling
    bodies = [b"not json", b"\xff\xfe{", json.dumps([{"event": "telemetry"}]).encode(), BODY]
    with CaptureProxy(store, ProxyOptions(upstream=upstream.url, require_credentials=False)) as proxy:
        for body in bodies:
            raw(proxy.port, post(origin, key, body))
        raw(proxy.port, post(origin, key + b"content-encoding: gzip\r\n", gzip.compress(BODY)))
        raw(
            proxy.port,
            b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\n%stransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            b"8\r\nnot json\r\n0\r\n\r\n" % (origin.encode(), key),
        )
        handed = b"GET %s/v1/models HTTP/1.1\r\nhost: x\r\n\r\n" % origin.encode()
        raw(proxy.port, handed, then=post(origin, key, b"\xff"))
        assert proxy.flush(timeout=10)
    assert llm.calls() == []  # the original host got no POST, only the model list
    sent = upstream.calls("/chat/completions")
    assert len(sent) == 7
    assert all(SECRET not in json.dumps(c["headers"]) for c in sent)
    assert len(turns(store.path)) == 2  # the two bodies that are calls (plain, gzipped) are turns


def test_an_upstream_with_no_server_answers_503_and_never_falls_back(store, llm, upstream, tmp_path, monkeypatch):
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    record = PolicyServer(
        url=upstream.url,
        pid=os.getpid(),
        base_model="m",
        served_model="m",
        current="m",
        log_path="",
        python="",
        started_at=datetime.now(UTC).isoformat(),
    )
    write_policy(record)
    with CaptureProxy(store, ProxyOptions(upstream="policy", token_ids=False, require_credentials=False)) as proxy:
        (tmp_path / "policy.json").unlink()  # the policy server went away
        time.sleep(0.7)  # the record is looked at every 0.5 s
        front = raw(proxy.port, post(llm.url))
        chunked = raw(
            proxy.port,
            b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n"
            b"%x\r\n%s\r\n0\r\n\r\n" % (llm.url.encode(), len(BODY), BODY),
        )
    assert front.startswith(b"HTTP/1.1 503") and chunked.startswith(b"HTTP/1.1 503")
    assert b"no server to send the call to" in front + chunked
    assert llm.requests == [] and upstream.calls("/chat/completions") == []


# --- an exposed proxy ---------------------------------------------------------------------------------


def exposed(env: dict[str, str], *args: str) -> tuple[subprocess.Popen, int]:
    return serve_proxy(env, *args, host="0.0.0.0")


def stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    proc.wait(30)
    return proc.stderr.read()


def test_an_exposed_proxy_wants_credentials_and_keeps_off_private_addresses(capture_env, llm):
    proc, port = exposed(capture_env)
    try:
        assert raw(port, post(llm.url)).startswith(b"HTTP/1.1 407")  # no anonymous use, even with --serve
        minted = json.loads(run_lcap(["episode", "new", "--port", str(port), "--json"], capture_env).stdout)
        user, _, password = minted["proxy_url"].split("//", 1)[1].split("@", 1)[0].partition(":")
        auth = basic(user, password)
        refused = {
            "a call to a loopback address": raw(port, post(llm.url, auth)),
            "a tunnel to a loopback address": raw(
                port, b"CONNECT %s HTTP/1.1\r\n%s\r\n" % (llm.url[7:].encode(), auth)
            ),
            "a tunnel to a name of a loopback address": raw(port, b"CONNECT localhost:443 HTTP/1.1\r\n%s\r\n" % auth),
            "a link-local address": raw(port, b"CONNECT 169.254.169.254:80 HTTP/1.1\r\n%s\r\n" % auth),
        }
        for why, answer in refused.items():
            assert answer.startswith(b"HTTP/1.1 403") and b"--allow-private" in answer, (why, answer[:200])
        side = raw(
            port, b"GET %s/v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n%s\r\n" % (llm.url.encode(), auth)
        )
        assert side.startswith(b"HTTP/1.1 502") and b"non-public address" in side, side[:300]
    finally:
        stderr = stop(proc)
    assert "reachable from the network" in stderr and "private destinations are refused" in stderr
    assert llm.requests == []
    (row,) = turns(capture_env["LCAP_DB"])
    assert row["episode_id"] == minted["episode_id"] and "non-public address" in row["error"]


def test_an_exposed_proxy_still_reaches_its_upstream_and_what_it_is_allowed(capture_env, llm):
    proc, port = exposed(capture_env, "--upstream", llm.url)  # a private upstream, set by whoever runs lcap
    try:
        url = json.loads(run_lcap(["episode", "new", "--port", str(port), "--json"], capture_env).stdout)["proxy_url"]
        verify = ssl.create_default_context(cafile=str(ca_bundle()))
        with httpx.Client(proxy=url, verify=verify, timeout=30) as client:
            routed = client.post("https://api.openai.com/v1/chat/completions", json=CHAT)
    finally:
        stop(proc)
    assert routed.status_code == 200
    proc, port = exposed(capture_env, "--allow-private")
    try:
        url = json.loads(run_lcap(["episode", "new", "--port", str(port), "--json"], capture_env).stdout)["proxy_url"]
        with httpx.Client(proxy=url, timeout=30) as client:
            allowed = client.post(f"{llm.url}/v1/chat/completions", json=CHAT)
    finally:
        stderr = stop(proc)
    assert allowed.status_code == 200 and "private destinations are allowed" in stderr
    result = run_lcap(["proxy", "--serve", "--host", "0.0.0.0", "--anonymous"], capture_env)
    assert result.returncode == 2 and "--anonymous is refused there" in result.stderr
