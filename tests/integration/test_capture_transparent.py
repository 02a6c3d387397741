"""`--transparent`: agents that ignore proxy settings are captured too, in namespaces of their own.

Real clients in a real network namespace with no route out (only `lo`, lcap's iptables rules), real
mitmproxy and lcap's front, a real local upstream (FakeLLM: this machine has no internet, and its
resolver cannot resolve api.openai.com, so lcap's DNS answers with a stand-in address). They need
root (or user namespaces) and iptables: where those are missing the tests are skipped, except the
one that checks lcap's one-line error. JVM agents are also checked in the default mode.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fixtures_capture import AGENTS, LCAP, SECRET, agent, dns_query, open_files, run_lcap, turns
from machine import proc_stat

from lcap.capture.proxy.connections import original_destination
from lcap.capture.reach import netns
from lcap.capture.reach.dns import Resolver
from lcap.capture.reach.names import Names

TEXT = "Hello from the upstream."


INIT = str(Path(netns.__file__).with_name("netns_init.py"))


CHAT = '{"model":"m","messages":[{"role":"user","content":"hi"}]}'


NODE_FETCH = (
    'fetch("https://api.openai.com/v1/chat/completions", {method: "POST", headers: {"content-type": '
    '"application/json"}, body: JSON.stringify({model: "m", messages: [{role: "user", content: "hi"}]})})'
    '.then(r => r.json()).then(j => console.log("node fetch:", j.choices[0].message.content))'
)


def _probe() -> str | None:
    """Why a namespace cannot be set up here (None: it can), by setting one up as lcap does."""
    if (lacking := netns.missing()) is not None:
        return lacking
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    config = {
        "rootless": os.geteuid() != 0,
        "iptables_restore": netns.restore_program(),
        "rules": netns.rules([]),
        "mounts": [],
        "parent": os.getpid(),
    }
    ours.send(json.dumps(config).encode())
    done = subprocess.run(
        [sys.executable, "-I", "-S", INIT, str(theirs.fileno()), "--", "true"],
        pass_fds=(theirs.fileno(),),
        capture_output=True,
        text=True,
        timeout=60,
    )
    ours.close()
    theirs.close()
    return done.stderr.strip() or None if done.returncode else None


@pytest.fixture(scope="session")
def transparent_ok() -> None:
    why = _probe()
    if why:
        pytest.skip(f"--transparent is not possible here: {why}")


@pytest.fixture
def banner_server():
    """A server that speaks first (like SSH), on every address of the host: reached from a namespace through
    the host's own non-loopback address."""
    server = socket.create_server(("0.0.0.0", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"SSH-2.0-lcap-test\r\n")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def _host_address() -> str | None:
    """An address of this host that is not loopback (the namespace reaches it only through lcap)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for probe in ("192.0.2.1", "10.255.255.255"):
            try:
                sock.connect((probe, 9))
                address = sock.getsockname()[0]
            except OSError:
                continue
            if not address.startswith("127.") and address != "0.0.0.0":
                return address
    return None


def test_proxyless_clients_are_captured(capture_env, llm, transparent_ok, banner_server):
    """aiohttp's default session, requests with trust_env off, a hand-written TLS client and plain HTTP on port 80:
    every LLM call stored in the episode, streams unbuffered; the host's loopback service and a server that
    speaks first reached through lcap, unstored; UDP off the machine refused."""
    db = capture_env["LCAP_DB"]
    host = _host_address()
    banner = ["banner", f"{host}:{banner_server}"] if host else []
    env = {**capture_env, "LOCAL_URL": llm.url}
    modes = ["aiohttp", "aiohttp_stream", "requests", "raw", "http", "loopback", *banner, "udp"]
    result = run_lcap(
        [
            "proxy",
            "--transparent",
            "--upstream",
            llm.url,
            "--episode",
            "ep-t",
            "--",
            *agent("proxyless_agent.py"),
            *modes,
        ],
        env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout.splitlines()
    for mode in ("aiohttp", "requests", "raw", "http"):
        assert f"{mode}: {TEXT}" in out
    assert [line for line in out if line.startswith("aiohttp_stream:")] == [
        f"aiohttp_stream: {w}" for w in ("Hello", "from", "the", "upstream.")
    ]
    assert "loopback: fake-model" in out
    if host:
        assert "banner: SSH-2.0-lcap-test" in out
    assert "udp: refused 1" in out  # EPERM: the namespace rejects UDP leaving it
    rows = turns(db)
    assert [(r["episode_id"], r["host"], r["stream"], r["status_code"]) for r in rows] == [
        ("ep-t", "api.openai.com", False, 200),
        ("ep-t", "api.openai.com", True, 200),
        ("ep-t", "api.openai.com", False, 200),
        ("ep-t", "api.openai.com", False, 200),
        ("ep-t", "api.openai.com", False, 200),
    ]
    assert all(r["completion_text"] == TEXT and r["upstream"] == llm.url for r in rows)
    # the agent's loopback call reached the host's service (lcap's own probe of the upstream is the other GET)
    assert [c["headers"].get("User-Agent", "")[:13] for c in llm.requests if c["method"] == "GET"].count(
        "Python-urllib"
    ) == 1
    for call in llm.calls():
        assert SECRET not in json.dumps(call["headers"])


def test_unbuffered_stream_in_a_namespace(capture_env, llm, transparent_ok):
    """The upstream holds the stream after its first event until the agent has printed it: buffering would hang."""
    llm.gate = threading.Event()
    proc = subprocess.Popen(
        [LCAP, "proxy", "--transparent", "--upstream", llm.url, "--", *agent("proxyless_agent.py"), "aiohttp_stream"],
        env=capture_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "aiohttp_stream: Hello"
        llm.gate.set()
        out, err = proc.communicate(timeout=60)
    finally:
        llm.gate.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.split() == ["aiohttp_stream:", "from", "aiohttp_stream:", "the", "aiohttp_stream:", "upstream."]


def test_trust_without_variables(capture_env, llm, transparent_ok):
    """With every CA variable removed (as a sandbox or sudo would), curl, Python's default context and Java still
    trust lcap inside the namespace: its CA is in the system paths as seen there, and only there. Node's fetch
    (without lcap's preload, which does nothing there anyway) trusts it through NODE_EXTRA_CA_CERTS."""
    java = shutil.which("java")
    unset = "-u SSL_CERT_FILE -u CURL_CA_BUNDLE -u REQUESTS_CA_BUNDLE -u NODE_EXTRA_CA_CERTS -u JAVA_TOOL_OPTIONS"
    script = [
        f"env {unset} curl -sS --noproxy '*' https://api.openai.com/v1/chat/completions "
        f"-H 'content-type: application/json' -d '{CHAT}' | {sys.executable} -c "
        "\"import json,sys; print('curl:', json.load(sys.stdin)['choices'][0]['message']['content'])\"",
        f"env {unset} {sys.executable} {AGENTS / 'proxyless_agent.py'} urllib",
    ]
    if shutil.which("node"):  # Node's fetch without lcap's preload; Node reads its own roots, and NODE_EXTRA_CA_CERTS
        script.append(f"env -u NODE_OPTIONS node -e '{NODE_FETCH}'")
    if java:
        script.append(f"env {unset} java {AGENTS / 'JavaAgent.java'} httpclient")
    result = run_lcap(
        ["proxy", "--transparent", "--upstream", llm.url, "--", "sh", "-ec", " && ".join(script)], capture_env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    expected = [f"curl: {TEXT}", f"urllib: {TEXT}"]
    expected += ([f"node fetch: {TEXT}"] if shutil.which("node") else []) + ([f"httpclient: {TEXT}"] if java else [])
    assert result.stdout.splitlines() == expected
    assert len(turns(capture_env["LCAP_DB"])) == len(expected)
    ca = (Path(capture_env["LCAP_HOME"]) / "ca" / "mitmproxy-ca-cert.pem").read_text().strip()
    assert ca not in Path("/etc/ssl/certs/ca-certificates.crt").read_text()  # the host's own bundle is untouched


def test_sdk_agents_in_a_namespace(capture_env, llm, transparent_ok, node_modules):
    """The SDK agents of the default mode's tests, unmodified (OpenAI and Anthropic in Python, OpenAI in Node,
    the Responses API over a WebSocket), with no proxy variable set; token ids from a vLLM-like upstream."""
    llm.vllm = True
    # a proxy nothing listens on: lcap must not pass it to the agent (the SDKs would use it)
    env = {**capture_env, "LCAP_TEST_NODE_MODULES": str(node_modules), "HTTPS_PROXY": "http://127.0.0.1:9"}
    py = sys.executable
    script = " && ".join(
        [
            f"{py} {AGENTS / 'openai_agent.py'} chat chat_stream responses_stream",
            f"{py} {AGENTS / 'anthropic_agent.py'} stream",
            f"node {AGENTS / 'openai_agent.cjs'}",
            f"{py} {AGENTS / 'ws_agent.py'}",
            'test -z "$HTTPS_PROXY$HTTP_PROXY$https_proxy" && echo no-proxy-variables',
        ]
    )
    result = run_lcap(["proxy", "--transparent", "--upstream", llm.url, "--", "sh", "-ec", script], env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line for line in result.stdout.splitlines() if not line.startswith("delta:")] == [
        f"chat: {TEXT}",
        f"chat_stream: {TEXT}",
        f"responses_stream: {TEXT}",
        f"stream: {TEXT}",
        f"node chat: {TEXT}",
        f"node stream: {TEXT}",
        f"ws: {TEXT}",
        f"ws: {TEXT}",
        "no-proxy-variables",
    ]
    rows = sorted(turns(capture_env["LCAP_DB"]), key=lambda r: r["seq"])
    assert [(r["dialect"], r["transport"], r["stream"], r["host"]) for r in rows] == [
        ("chat", "http", False, "api.openai.com"),
        ("chat", "http", True, "api.openai.com"),
        ("responses", "http", True, "api.openai.com"),
        ("messages", "http", True, "api.anthropic.com"),
        ("chat", "http", False, "api.openai.com"),
        ("chat", "http", True, "api.openai.com"),
        ("responses", "websocket", True, "api.openai.com"),
        ("responses", "websocket", True, "api.openai.com"),
    ]
    assert rows[0]["prompt_token_ids"] and rows[0]["token_source"] == "vllm"
    assert len({r["episode_id"] for r in rows}) == 1


def test_java_default_mode(capture_env, llm, tmp_path):
    """Without --transparent, the JVM (which ignores HTTPS_PROXY) is pointed at its episode's own port and trust
    store by JAVA_TOOL_OPTIONS: HttpClient and HttpURLConnection are captured, into the right episode. That port
    needs no credentials, so it serves the agent's processes only: another process that finds it gets a 403."""
    if shutil.which("java") is None:
        pytest.skip("no JDK")
    options, go = tmp_path / "options", tmp_path / "go"
    script = (
        f'echo "$JAVA_TOOL_OPTIONS" > {options}; while [ ! -e {go} ]; do sleep 0.05; done; '
        f"exec java {AGENTS / 'JavaAgent.java'} httpclient urlconnection"
    )
    proc = subprocess.Popen(
        [LCAP, "proxy", "--upstream", llm.url, "--episode", "ep-java", "--", "sh", "-c", script],
        env=capture_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (options.exists() and options.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.05)
        port = int(options.read_text().split("-Dhttps.proxyPort=")[1].split()[0])
        for head in (
            b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n\r\n",
            f"POST {llm.url}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(CHAT)}\r\n\r\n{CHAT}".encode(),
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as outsider:
                outsider.sendall(head)
                answer = outsider.recv(4096)
            assert answer.startswith(b"HTTP/1.1 403") and b"ep-java's agent only" in answer, answer
        go.write_text("go")
        out, err = proc.communicate(timeout=300)
    finally:
        go.write_text("go")
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert out.splitlines() == [f"httpclient: {TEXT}", f"urlconnection: {TEXT}"]
    assert "Picked up JAVA_TOOL_OPTIONS" in err
    rows = turns(capture_env["LCAP_DB"])
    assert [(r["episode_id"], r["host"], r["status_code"]) for r in rows] == [("ep-java", "api.openai.com", 200)] * 2
    assert len(llm.calls()) == 2


def test_collect_one_namespace_per_episode(tmp_path, monkeypatch, capture_env, llm, transparent_ok):
    """Concurrent episodes, each in its own namespace: every turn lands in its own episode, without credentials."""
    from lcap.dataset.collect.episodes import collect_episodes
    from lcap.dataset.options import CollectOptions
    from lcap.store import Store

    monkeypatch.chdir(tmp_path)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}"}) + "\n" for i in range(2)))
    script = tmp_path / "agent.sh"
    # the four agents wait for each other (up to 30 s) so that their namespaces are alive at once: a namespace's
    # inode number is reused once it is gone
    started = tmp_path / "started"
    started.mkdir()
    script.write_text(
        f'#!/bin/sh\nset -e\necho "$LCAP_EPISODE_ID $(stat -L -c %i /proc/self/ns/net)"\n'
        f"touch {started}/$LCAP_EPISODE_ID\n"
        f'for i in $(seq 300); do [ "$(ls {started} | wc -l)" -ge 4 ] && break; sleep 0.1; done\n'
        f"{sys.executable} {AGENTS / 'proxyless_agent.py'} aiohttp raw\n"
    )
    script.chmod(0o755)
    store = Store(tmp_path / "c.duckdb")
    options = CollectOptions(group_size=2, concurrency=4, upstream=llm.url, transparent=True, timeout=120)
    result = collect_episodes(store, tasks=tasks, command=[str(script)], options=options, labels={}, progress=False)
    assert (result.episodes, result.finished) == (4, 4), result.statuses
    rows = turns(tmp_path / "c.duckdb")
    episodes = {r[0] for r in store.fetchall("SELECT episode_id FROM episodes")}
    assert len(rows) == 8 and {r["episode_id"] for r in rows} == episodes
    assert all(sum(r["episode_id"] == e for r in rows) == 2 for e in episodes)
    namespaces = set()
    for out in Path(result.run_dir).glob("**/stdout.txt"):
        episode, inode = out.read_text().splitlines()[0].split()
        assert episode in episodes
        namespaces.add(inode)
    assert len(namespaces) == 4  # one network namespace each
    # and none of them is left: a process now in a namespace of one of those numbers is another's (another xdist
    # worker's, which got a freed number) unless it is one of these episodes'
    assert not [p for inode in namespaces for p in _in_namespace(int(inode)) if _episode_of(p) in episodes]


def _episode_of(pid: int) -> str | None:
    """The LCAP_EPISODE_ID in process `pid`'s environment, if any."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((v[len(b"LCAP_EPISODE_ID=") :].decode() for v in environ if v.startswith(b"LCAP_EPISODE_ID=")), None)


def _in_namespace(inode: int, kind: str = "net", started_by: float | None = None) -> list[int]:
    """Processes whose `kind` namespace is `inode`; with `started_by` (seconds of the boot clock), only those that
    started by then. The kernel gives a freed namespace's number to the next one made, at once, and the other xdist
    workers make namespaces all the time: a process started later is in a new namespace of the same number."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/{kind}").st_ino != inode:
                continue
        except OSError:
            continue
        if started_by is not None and ((stat := proc_stat(int(pid))) is None or stat.started > started_by):
            continue
        found.append(int(pid))
    return found


@pytest.mark.parametrize("transparent", [True, False], ids=["transparent", "default"])
def test_episode_listeners_end_with_the_episode(capture_env, llm, monkeypatch, request, transparent):
    """An episode's listeners (in `--transparent`, its namespace's TCP and DNS sockets, which hold the namespace; by
    default, its JVM port) are closed when it ends: the process's sockets are back to what they were before it.
    Other threads of the test process may hold a socket a moment: each count waits up to 2 s for the baseline."""
    from lcap.capture.options import ProxyOptions
    from lcap.capture.proxy.server import CaptureProxy
    from lcap.processes import run_child
    from lcap.store import Store

    if transparent:
        request.getfixturevalue("transparent_ok")
    monkeypatch.setenv("LCAP_HOME", capture_env["LCAP_HOME"])

    def settled(baseline: int) -> int:
        deadline = time.monotonic() + 2
        while (count := open_files("socket")) != baseline and time.monotonic() < deadline:
            time.sleep(0.05)
        return count

    options = ProxyOptions(upstream=llm.url, transparent=transparent)
    with CaptureProxy(Store(capture_env["LCAP_DB"]), options) as proxy:
        baseline = open_files("socket")
        counts = []
        for n in range(4):
            with proxy.episode_child(f"ep-{n}", ["true"]) as child:
                assert run_child(child.argv, child.env, pass_fds=child.pass_fds).code == 0
            counts.append(settled(baseline))
        assert counts == [baseline] * 4, (baseline, counts)


def test_exit_code_and_signals(capture_env, llm, transparent_ok):
    """The agent is the process lcap started (the namespace's set-up execs it): its exit code and the signals
    lcap forwards are the same as in the default mode."""
    result = run_lcap(["proxy", "--transparent", "--upstream", llm.url, "--", "sh", "-c", "exit 3"], capture_env)
    assert result.returncode == 3, result.stderr
    proc = subprocess.Popen(
        [
            LCAP,
            "proxy",
            "--transparent",
            "--",
            "sh",
            "-c",
            "trap 'echo got TERM; exit 7' TERM; echo ready; while :; do sleep 0.1; done",
        ],
        env=capture_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7 and out.strip() == "got TERM", err
    missing = run_lcap(["proxy", "--transparent", "--", "no-such-agent-cmd"], capture_env)
    assert missing.returncode == 2 and "cannot run no-such-agent-cmd" in missing.stderr


def test_kill_9_leaves_nothing_behind(capture_env, llm, transparent_ok):
    """lcap killed with SIGKILL: its agent goes with it, and with the agent its namespaces, their rules and their
    mounts; nothing was ever set on the host (its iptables rules and mounts are as they were)."""
    host_rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    host_mounts = Path("/proc/self/mountinfo").read_text()
    proc = subprocess.Popen(
        [LCAP, "proxy", "--transparent", "--upstream", llm.url, "--", *agent("proxyless_agent.py"), "whoami"],
        env=capture_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[0] == "whoami:", line
    net, mnt, pid = int(line[1]), int(line[2]), int(line[3])
    assert _in_namespace(net) == [pid] and net != os.stat("/proc/self/ns/net").st_ino
    assert _in_namespace(mnt, "mnt") == [pid]
    killed = time.clock_gettime(time.CLOCK_BOOTTIME)  # the clock of a process's start time in /proc/PID/stat
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _in_namespace(net, started_by=killed) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _in_namespace(net, started_by=killed)
    assert not _in_namespace(mnt, "mnt", started_by=killed)
    assert subprocess.run(["iptables-save"], capture_output=True, text=True).stdout.count("REDIRECT") == (
        host_rules.count("REDIRECT")
    )
    added = set(Path("/proc/self/mountinfo").read_text().splitlines()) - set(host_mounts.splitlines())
    assert not [m for m in added if not _sandbox_work(m)], added


def _sandbox_work(mount: str) -> bool:
    """An episode's work folder that `lcap collect --sandbox`, on another worker or another run, mounted meanwhile."""
    return mount.split()[4].endswith("/work") and "uid=65534,gid=65534" in mount


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to hide iptables")
def test_missing_iptables_is_one_line(capture_env, tmp_path):
    """No iptables (hidden in a private mount namespace), or one that fails: one line, exit 2, and the default mode
    is named as the way that still works."""
    empty = tmp_path / "empty"
    empty.mkdir()
    hide = " && ".join(f"mount --bind {empty} {d}" for d in netns.SBIN if os.path.isdir(d) and not os.path.islink(d))
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{hide} && exec "$@"', "sh", LCAP, "proxy", "--transparent", "--", "true"],
        env=capture_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "lcap: --transparent needs iptables (iptables-restore; `apt-get install iptables`, or scripts/setup.sh); "
        "the default mode (without --transparent) still works"
    ]
    fake = tmp_path / "iptables-restore"
    fake.write_text(
        "#!/bin/sh\necho 'iptables-restore v1.8.9 (nf_tables): Could not fetch rule set generation id' >&2\nexit 4\n"
    )
    fake.chmod(0o755)
    real = netns.restore_program()
    result = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'mount --bind {fake} {real} && exec "$@"',
            "sh",
            LCAP,
            "proxy",
            "--transparent",
            "--",
            "true",
        ],
        env=capture_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("lcap: --transparent: cannot set up the agent's namespace: iptables-restore: ")
    assert "Could not fetch rule set generation id" in line and line.endswith("still works")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to become another user")
def test_rootless_namespace(transparent_ok):
    """Without root: a user namespace maps the user's own ids (the agent keeps them), iptables still loads (with
    CAP_NET_ADMIN kept across its exec), the bundle is bound, and a connection is redirected to the listener."""
    if not netns.user_namespaces_allowed() or not Path("/usr/bin/python3").exists():
        pytest.skip("no unprivileged user namespaces, or no system Python for another user")
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="lcap-rootless-"))  # pytest's own tmp is private to root
    shared.chmod(0o755)
    bundle = shared / "bundle.pem"
    bundle.write_text("lcap bundle\n")
    bundle.chmod(0o644)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    config = {
        "rootless": True,
        "iptables_restore": netns.restore_program(),
        "rules": netns.rules([]),
        "mounts": [[str(bundle), "/etc/ssl/certs/ca-certificates.crt"]],
        "parent": os.getpid(),
    }
    ours.send(json.dumps(config).encode())
    agent_code = (
        "import os, socket; print(os.getuid(), open('/etc/ssl/certs/ca-certificates.crt').read().strip()); "
        "s = socket.create_connection(('203.0.113.7', 443), timeout=10); print(s.recv(64).decode())"
    )
    user = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    child = subprocess.Popen(
        [*user, "/usr/bin/python3", "-I", "-S", INIT, str(theirs.fileno()), "--", "/usr/bin/python3", "-c", agent_code],
        pass_fds=(theirs.fileno(),),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    ours.settimeout(60)
    message, fds, _, _ = socket.recv_fds(ours, 4096, 2)
    assert "error" not in json.loads(message) and len(fds) == 2
    listener = socket.socket(fileno=fds[0])
    listener.settimeout(60)
    conn, _ = listener.accept()
    assert original_destination(conn) == ("203.0.113.7", 443)
    conn.sendall(b"redirected")
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out.splitlines() == ["65534 lcap bundle", "redirected"]
    for sock in (conn, listener, socket.socket(fileno=fds[1]), ours):
        sock.close()
    shutil.rmtree(shared)


def _answers(response: bytes) -> tuple[int, list[str]]:
    """(rcode, A records) of a response to `dns_query`."""
    rcode, count = struct.unpack_from("!H", response, 2)[0] & 0xF, struct.unpack_from("!H", response, 6)[0]
    offset = 12
    if struct.unpack_from("!H", response, 4)[0]:  # the question, echoed
        while response[offset]:
            offset += response[offset] + 1
        offset += 5
    addresses = []
    for _ in range(count):
        _, _, _, _, size = struct.unpack_from("!HHHIH", response, offset)
        addresses.append(socket.inet_ntoa(response[offset + 12 : offset + 12 + size]))
        offset += 12 + size
    return rcode, addresses


def test_dns_answers():
    """A through the host's resolver; a stand-in address for a name the host cannot resolve while calls are
    rerouted (NXDOMAIN otherwise), the same one each time, and the name known again from the address; AAAA
    empty; what is not a query, nothing or FORMERR; other types relayed to the host's nameservers."""
    import asyncio

    relayed = []
    nameserver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    nameserver.bind(("127.0.0.1", 0))

    def answer_txt() -> None:
        data, peer = nameserver.recvfrom(512)
        relayed.append(data)
        nameserver.sendto(data[:2] + b"\x81\x80" + data[4:], peer)

    threading.Thread(target=answer_txt, daemon=True).start()
    names = Names()
    rerouting = [True]
    resolver = Resolver(names, lambda: rerouting[0], nameservers=[nameserver.getsockname()])

    async def main() -> None:
        assert _answers(await resolver.answer(dns_query("localhost"))) == (0, ["127.0.0.1"])
        rcode, (stand_in,) = _answers(await resolver.answer(dns_query("no-such-host.invalid")))
        assert rcode == 0 and socket.inet_aton(stand_in) and stand_in.startswith("198.1")
        assert _answers(await resolver.answer(dns_query("No-Such-Host.invalid"))) == (0, [stand_in])
        assert names.name_of(stand_in) == "no-such-host.invalid" and names.is_stand_in(stand_in)
        rerouting[0] = False
        assert _answers(await resolver.answer(dns_query("other-host.invalid")))[0] in (3, 2)  # NXDOMAIN / SERVFAIL
        assert _answers(await resolver.answer(dns_query("localhost", qtype=28))) == (0, [])  # AAAA: IPv4 only
        assert await resolver.answer(b"\x00") is None
        assert await resolver.answer(dns_query("x")[:2] + b"\x81\x80" + dns_query("x")[4:]) is None  # a response
        assert _answers(await resolver.answer(dns_query("x")[:12] + b"\xff"))[0] == 1  # FORMERR
        txt = await resolver.answer(dns_query("example.test", qtype=16, ident=0x4242))
        assert txt is not None and txt[:2] == b"\x42\x42" and relayed and relayed[0][:2] == b"\x42\x42"

    asyncio.run(main())
    nameserver.close()


def test_namespace_rules_and_host_ports(tmp_path, monkeypatch):
    """The rules send DNS and all TCP to lcap, keep loopback inside except the host's listening ports, refuse UDP
    leaving; the host's loopback ports are read from /proc/net/tcp{,6} (LISTEN on loopback or a wildcard)."""
    text = netns.rules(list(range(1, 18)))
    lines = text.splitlines()
    assert lines[2] == "-A OUTPUT -p udp --dport 53 -j REDIRECT --to-ports {dns}"
    assert "--dports 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 " in lines[3] and "--dports 16,17 " in lines[4]
    assert lines[5:7] == ["-A OUTPUT -d 127.0.0.0/8 -j RETURN", "-A OUTPUT -p tcp -j REDIRECT --to-ports {tcp}"]
    assert "-A OUTPUT -p udp ! -d 127.0.0.0/8 -j REJECT --reject-with icmp-port-unreachable" in lines
    with socket.create_server(("127.0.0.1", 0)) as on_loopback, socket.create_server(("0.0.0.0", 0)) as wildcard:
        ports = netns.host_loopback_ports()
        assert on_loopback.getsockname()[1] in ports and wildcard.getsockname()[1] in ports
    assert netns._loopback_reachable("0100007F") and not netns._loopback_reachable("0202000A")
    assert netns._loopback_reachable("00000000000000000000000001000000")  # ::1
    assert not netns._loopback_reachable("0000000000000000FFFF00000202000A")  # ::ffff:10.0.2.2


def test_peers_tell_the_agents_connections_from_others():
    """The connection a process (or one under it) made is found in its tree, over IPv4 and IPv4-mapped IPv6 (the
    JVM's dual-stack sockets); another process's tree does not hold it."""
    from lcap.capture.reach.peers import from_tree

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(30)
        code = f"import socket, sys; s = socket.create_connection((sys.argv[1], {port})); sys.stdin.read()"
        other = subprocess.Popen(["sleep", "30"])
        try:
            for address in ("127.0.0.1", "::ffff:127.0.0.1"):
                wrapper = subprocess.Popen(
                    ["sh", "-c", f'{sys.executable} -c "{code}" {address}; true'], stdin=subprocess.PIPE
                )
                try:
                    conn, peer = server.accept()
                    with conn:
                        listener = ("127.0.0.1", port)
                        assert from_tree(wrapper.pid, listener, peer[:2]), address
                        assert not from_tree(other.pid, listener, peer[:2])
                finally:
                    assert wrapper.stdin is not None
                    wrapper.stdin.close()  # the client reads its stdin to the end, then exits, and the shell too
                    wrapper.wait(30)
        finally:
            other.kill()
            other.wait()


# Debian's OkHttp (libokhttp-java, installed by scripts/setup.sh) and its Okio.
OKHTTP_JARS = (Path("/usr/share/java/okhttp.jar"), Path("/usr/share/java/okio.jar"))


@pytest.mark.parametrize("transparent", [False, True], ids=["default", "transparent"])
def test_okhttp_agent(capture_env, llm, transparent, request):
    """OkHttp (the JVM client under many LLM SDKs): captured in the default mode through JAVA_TOOL_OPTIONS, and with
    --transparent."""
    jars = OKHTTP_JARS
    if shutil.which("java") is None or not all(jar.exists() for jar in jars):
        pytest.skip("no JDK, or no OkHttp (scripts/setup.sh installs Debian's libokhttp-java)")
    if transparent:
        request.getfixturevalue("transparent_ok")
    flag = ["--transparent"] if transparent else []
    classpath = ":".join(map(str, jars))
    result = run_lcap(
        ["proxy", *flag, "--upstream", llm.url, "--", "java", "-cp", classpath, str(AGENTS / "OkHttpAgent.java")],
        capture_env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [f"okhttp: {TEXT}"]
    rows = turns(capture_env["LCAP_DB"])
    assert [(r["host"], r["status_code"], r["completion_text"]) for r in rows] == [("api.openai.com", 200, TEXT)]
