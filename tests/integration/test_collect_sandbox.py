"""`lcap collect --sandbox`: each episode in a bubblewrap sandbox of its own (real bwrap, cgroups v1, a real
capture proxy in front of a stub upstream, a real DuckDB file). One collect runs an agent that reaches its LLM
beside agents that each try one escape; every escape ends its episode with a recorded reason while the others
complete, and the host is untouched."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from fixtures_capture import SocketServer, wait_until

from lcap.capture.sandbox import CGROUPS, GROUP, listen_in, missing
from lcap.config import LcapError
from lcap.dataset.collect.episodes import collect_episodes
from lcap.dataset.options import CollectOptions
from lcap.store import Store

SYSTEM_PYTHON = "/usr/bin/python3"  # the agent runs as nobody, who cannot reach a Python under /root
pytestmark = [
    pytest.mark.skipif(missing() is not None, reason=f"--sandbox cannot run here: {missing()}"),
    pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"no {SYSTEM_PYTHON}"),
]

MEMORY_MB, PIDS, DISK_MB, TIMEOUT = 96, 32, 16, 12.0

AGENT = r"""
import json, os, socket, sys, time, urllib.request
task = json.loads(os.environ["LCAP_TASK"])
mode = task["mode"]
if mode == "llm":
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request("http://api.openai.com/v1/chat/completions", body,
                                 {"Content-Type": "application/json", "Authorization": "Bearer k"})
    answer = json.load(urllib.request.urlopen(req, timeout=30))
    open("answer.txt", "w").write(answer["choices"][0]["message"]["content"])
elif mode == "write_outside":
    open(task["target"], "w").write("escaped")
elif mode == "host_port":
    socket.create_connection(("127.0.0.1", task["port"]), timeout=5).sendall(b"escaped")
elif mode == "fork_bomb":
    for _ in range(4 * task["pids"]):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
elif mode == "memory":
    hog = [bytearray(1 << 20) for _ in range(4 * task["memory_mb"])]
elif mode == "disk":
    with open("fill.bin", "wb") as f:
        for _ in range(4 * task["disk_mb"]):
            f.write(b"x" * (1 << 20))
            f.flush()
elif mode == "hang":
    time.sleep(600)
elif mode == "via_proxy":  # through the episode's own listener, to the host's loopback
    host, port = os.environ["HTTP_PROXY"].rsplit("/", 1)[1].rsplit(":", 1)
    answers = {}
    for name, request in task["requests"].items():
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(request.encode())
            answer, deadline = b"", time.time() + 30
            while b"non-public" not in answer and time.time() < deadline:
                got = conn.recv(4096)
                if not got:
                    break
                answer += got
            answers[name] = answer.decode("utf-8", "replace")
    print(json.dumps(answers))
elif mode == "view":  # what of the host it sees: a canary in the host's /tmp, another run's folder, a share
    seen = {p: os.path.exists(p) for p in (task["canary"], task["other_run"], "/root", "/home", "/work", "/etc/shadow")}
    shared = open(task["shared"]).read()
    try:
        open(task["shared"], "a").write("changed")
        wrote = True
    except OSError:
        wrote = False
    try:
        shadow = open("/etc/shadow").read()
    except OSError:
        shadow = None
    print(json.dumps({"seen": seen, "shared": shared, "wrote_share": wrote, "shadow": shadow, "tmp": os.listdir("/tmp")}))
elif mode == "secrets":
    found = []
    for root in task["probe"]:
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    open(os.path.join(dirpath, name), "rb").read(1)
                    found.append(os.path.join(dirpath, name))
                except OSError:
                    pass
        if os.path.isfile(root):
            try:
                open(root, "rb").read(1)
                found.append(root)
            except OSError:
                pass
    mine = os.environ["LCAP_EPISODE_ID"]
    deadline = time.time() + 3
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read()
            except OSError:
                continue
            if b"LCAP_EPISODE_ID=" in environ and mine.encode() not in environ:
                found.append(f"/proc/{pid}/environ")
        time.sleep(0.2)
    status = open("/proc/self/status").read()
    caps = [l.split()[1] for l in status.splitlines() if l.startswith("CapEff")][0]
    print(json.dumps({"found": sorted(set(found)), "uid": os.getuid(), "caps": caps}))
"""


class Listener(SocketServer):
    """A host loopback port that counts the connections it gets."""

    def __init__(self) -> None:
        self.accepted = 0
        super().__init__(self._count)

    def _count(self, conn: socket.socket) -> None:
        self.accepted += 1
        conn.close()


@pytest.fixture(scope="module")
def sandboxed(fake_llm):
    """One sandboxed collect over every mode; (store, {mode: episode row}, outside target, listener, run_dir)."""
    base = Path(tempfile.mkdtemp(prefix="lcap-sandbox-"))  # the agent runs as nobody: pytest's tree is root's alone
    base.chmod(0o755)
    home, db_dir = base / "home", base / "db"
    db_dir.mkdir()
    old_home, old_cwd = os.environ.get("LCAP_HOME"), os.getcwd()
    os.environ["LCAP_HOME"] = str(home)
    os.chdir(base)
    fake_llm.reset()
    listener = Listener()
    target = base / "outside.txt"
    store = Store(db_dir / "lcap.duckdb")
    (base / "agent.py").write_text(AGENT)
    common = {"pids": PIDS, "memory_mb": MEMORY_MB, "disk_mb": DISK_MB}
    modes = ["llm", "write_outside", "host_port", "fork_bomb", "memory", "disk", "hang", "secrets", "via_proxy", "view"]
    outside = Path(tempfile.mkdtemp(prefix="lcap-outside-"))  # in the host's /tmp, beside the base: not shown
    outside.chmod(0o755)  # world-readable: what keeps it out is the sandbox, not its mode
    (outside / "canary.txt").write_text("canary")
    (outside / "other-run").mkdir()
    shared = Path(tempfile.mkdtemp(prefix="lcap-shared-"))
    shared.chmod(0o755)
    (shared / "data.txt").write_text("shared data")
    rows = [
        {
            "id": mode,
            "mode": mode,
            "target": str(target),
            "port": listener.port,
            "probe": [str(home), str(store.path), str(store.path) + ".wal"],
            "requests": _to_host_loopback(listener.port),
            "canary": str(outside / "canary.txt"),
            "other_run": str(outside / "other-run"),
            "shared": str(shared / "data.txt"),
            **common,
        }
        for mode in modes
    ]
    tasks = base / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = CollectOptions(
        group_size=1,
        concurrency=len(modes),
        upstream=fake_llm.url,
        timeout=TIMEOUT,
        sandbox=True,
        sandbox_memory=MEMORY_MB,
        sandbox_pids=PIDS,
        sandbox_disk=DISK_MB,
        keep_workspaces=True,
        sandbox_share=(str(shared),),
    )
    try:
        result = collect_episodes(
            store, tasks=tasks, command=[SYSTEM_PYTHON, str(base / "agent.py")], options=options, progress=False
        )
    finally:
        os.chdir(old_cwd)
        if old_home is None:
            os.environ.pop("LCAP_HOME", None)
        else:
            os.environ["LCAP_HOME"] = old_home
    episodes = {
        r[0]: {"id": r[1], "status": r[2], "error": r[3] or "", "turns": r[4]}
        for r in store.fetchall(
            "SELECT e.labels->>'task', e.episode_id, e.status, e.error, "
            "(SELECT count(*) FROM turns t WHERE t.episode_id = e.episode_id) FROM episodes e"
        )
    }
    yield store, episodes, target, listener, Path(result.run_dir)
    listener.close()
    for folder in (base, outside, shared):
        shutil.rmtree(folder, ignore_errors=True)


def _to_host_loopback(port: int) -> dict[str, str]:
    """Requests that ask the proxy for the host's loopback: absolute-form GET and CONNECT, by address, IPv6,
    `localhost`, and this machine's name where it resolves to loopback (/etc/hosts)."""
    requests = {
        "get": f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n",
        "connect": f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n",
        "connect_v6": f"CONNECT [::1]:{port} HTTP/1.1\r\nHost: [::1]:{port}\r\n\r\n",
        "get_localhost": f"GET http://localhost:{port}/ HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n",
        "connect_localhost": f"CONNECT localhost:{port} HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n",
    }
    name = socket.gethostname()
    with contextlib.suppress(OSError):
        if socket.gethostbyname(name).startswith("127."):
            requests["get_by_name"] = f"GET http://{name}:{port}/ HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n"
    return requests


def _stdout(run_dir: Path, episode_id: str) -> str:
    return (run_dir / "round-0" / episode_id / "stdout.txt").read_text()


def test_agent_reaches_its_llm_through_the_proxy(sandboxed):
    _, episodes, _, _, run_dir = sandboxed
    llm = episodes["llm"]
    assert llm["status"] == "ok", llm
    assert llm["turns"] == 1
    kept = run_dir / "round-0" / llm["id"] / "work" / "answer.txt"
    assert kept.read_text()  # --keep-workspaces: the workspace is on disk after the episode


def test_write_outside_the_workspace_is_refused(sandboxed):
    _, episodes, target, _, _ = sandboxed
    assert episodes["write_outside"]["status"] == "failed"
    assert "Read-only file system" in episodes["write_outside"]["error"]
    assert not target.exists()


def test_host_loopback_port_is_unreachable(sandboxed):
    _, episodes, _, listener, _ = sandboxed
    assert episodes["host_port"]["status"] == "failed", episodes["host_port"]
    assert listener.accepted == 0


def test_the_host_loopback_is_refused_through_the_episodes_own_proxy(sandboxed):
    """GET and CONNECT through the sandbox's listener to the host's 127.0.0.1, [::1], `localhost` and a name
    resolving to 127.0.0.1: each answered 403 by the proxy, none reaches the host's listener (issue 48 row 2:
    both reached it, and through it `lcap ui`). The LLM route the user named still works (the `llm` episode)."""
    _, episodes, _, listener, run_dir = sandboxed
    via = episodes["via_proxy"]
    assert via["status"] == "ok", via
    answers = json.loads(_stdout(run_dir, via["id"]).strip().splitlines()[-1])
    assert set(answers) >= {"get", "connect", "connect_v6", "get_localhost", "connect_localhost"}
    for name, answer in answers.items():  # the front answers 403; mitmproxy (absolute-form GET) its 502 with it
        assert answer.startswith(("HTTP/1.1 403", "HTTP/1.1 502")) and "non-public address" in answer, (name, answer)
    assert listener.accepted == 0


def test_fork_bomb_meets_the_process_limit(sandboxed):
    _, episodes, _, _, _ = sandboxed
    assert episodes["fork_bomb"]["status"] == "failed", episodes["fork_bomb"]
    assert f"process limit ({PIDS}) reached" in episodes["fork_bomb"]["error"]


def test_memory_past_the_limit_ends_the_episode(sandboxed):
    _, episodes, _, _, _ = sandboxed
    assert episodes["memory"]["status"] == "failed", episodes["memory"]
    assert f"memory limit ({MEMORY_MB} MiB) reached" in episodes["memory"]["error"]


def test_filling_the_disk_ends_the_episode(sandboxed):
    _, episodes, _, _, _ = sandboxed
    assert episodes["disk"]["status"] == "failed", episodes["disk"]
    assert f"disk limit ({DISK_MB} MiB) reached" in episodes["disk"]["error"]


def test_outliving_the_time_limit_ends_the_episode(sandboxed):
    _, episodes, _, _, _ = sandboxed
    assert episodes["hang"]["status"] == "timeout"
    assert f"timed out after {TIMEOUT:g}s" in episodes["hang"]["error"]


def test_agent_cannot_read_lcap_home_the_store_or_a_sibling(sandboxed):
    _, episodes, _, _, run_dir = sandboxed
    assert episodes["secrets"]["status"] == "ok", episodes["secrets"]
    report = json.loads(_stdout(run_dir, episodes["secrets"]["id"]).strip().splitlines()[-1])
    assert report["found"] == []
    assert report["uid"] != 0 and int(report["caps"], 16) == 0


def test_agent_sees_only_the_system_its_command_and_the_shares(sandboxed):
    """Of the host, a sandboxed agent sees the system folders (/etc without its secrets), its command's folder and
    each --sandbox-share, read-only: not a canary in the host's /tmp, another run's folder, /root, /home, /work."""
    _, episodes, _, _, run_dir = sandboxed
    assert episodes["view"]["status"] == "ok", episodes["view"]
    report = json.loads(_stdout(run_dir, episodes["view"]["id"]).strip().splitlines()[-1])
    seen = report["seen"]
    assert not any(seen[p] for p in seen if p != "/etc/shadow"), seen
    assert report["shadow"] in (None, ""), "the host's /etc/shadow is unreadable (a device node on a nodev mount)"
    assert report["shared"] == "shared data" and report["wrote_share"] is False
    # a private /tmp: only the folders above what is shown (the share, the agent's script's folder)
    assert all(name.startswith(("lcap-shared-", "lcap-sandbox-")) for name in report["tmp"]), report["tmp"]


def test_episodes_say_they_were_sandboxed_for_rescore(sandboxed):
    """`lcap rescore` verifies an episode collected with --sandbox in a sandbox: its label says so."""
    store = sandboxed[0]
    assert store.fetchall("SELECT DISTINCT labels->>'sandbox' FROM episodes") == [("true",)]


def test_host_is_left_as_it_was(sandboxed):
    """No workspace mount and no episode cgroup outlives the collect."""
    _, _, _, _, run_dir = sandboxed
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(run_dir) not in mounts
    for controller in ("memory", "pids"):
        left = [p.name for p in (CGROUPS / controller / GROUP).glob(f"*-{os.getpid()}")]
        assert left == []


def test_the_listener_waits_for_a_sandbox_loopback_address_that_comes_late():
    """bubblewrap reports its sandbox's pid while the sandbox may still be setting its loopback up, its interface up
    before 127.0.0.1 is on it (bind: EADDRNOTAVAIL, seen about once in 400 sandboxes under load): the proxy's
    listener there is made once the address is, not refused."""
    with subprocess.Popen(["unshare", "--net", "sleep", "60"]) as namespace:
        try:
            wait_until(lambda: os.readlink(f"/proc/{namespace.pid}/ns/net") != os.readlink("/proc/self/ns/net"))

            def loopback(*change: str) -> None:
                subprocess.run(["nsenter", "-t", str(namespace.pid), "-n", "ip", *change], check=True)

            loopback("link", "set", "lo", "up")
            loopback("addr", "del", "127.0.0.1/8", "dev", "lo")
            made: list[socket.socket] = []
            listening = threading.Thread(target=lambda: made.append(listen_in(namespace.pid, 0, timeout=30)))
            listening.start()
            time.sleep(0.5)  # the listener tries, and is refused
            assert not made
            loopback("addr", "add", "127.0.0.1/8", "dev", "lo")
            listening.join(30)
            (listener,) = made
            with listener:
                host, port = listener.getsockname()
                assert host == "127.0.0.1" and port > 0
        finally:
            namespace.kill()


def test_without_bubblewrap_sandbox_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t"}\n')
    with pytest.raises(LcapError, match="install the bubblewrap package") as err:
        collect_episodes(
            Store(tmp_path / "lcap.duckdb"),
            tasks=tasks,
            command=["true"],
            options=CollectOptions(group_size=1, upstream=None, sandbox=True),
            progress=False,
        )
    assert "\n" not in str(err.value)


def test_a_folder_nobody_cannot_enter_is_refused_before_any_episode(monkeypatch):
    """The sandbox runs the agent as nobody: a run folder, or a file of the agent's command, under a folder nobody
    may not enter is a one-line error naming that folder and the fix, before any episode; once nobody may pass
    through it (0711: enter, not list), the episode runs."""
    base = Path(tempfile.mkdtemp(prefix="lcap-sandbox-reach-"))  # 0700, as a folder under /root is
    try:
        private = base / "private"
        private.mkdir(mode=0o700)
        for folder in (base, private):
            (folder / "agent.py").write_text("open('done.txt', 'w').write('ran')\n")
        (base / "tasks.jsonl").write_text('{"id": "t"}\n')
        monkeypatch.setenv("LCAP_HOME", str(base / "home"))
        monkeypatch.delenv("LCAP_HARNESS_DIR", raising=False)
        monkeypatch.chdir(base)
        store = Store(base / "db" / "lcap.duckdb")
        options = CollectOptions(group_size=1, upstream=None, sandbox=True, run_dir=base / "run", timeout=60.0)

        def run(agent: Path):
            return collect_episodes(
                store, tasks=base / "tasks.jsonl", command=[SYSTEM_PYTHON, str(agent)], options=options, progress=False
            )

        with pytest.raises(LcapError) as closed_run_dir:
            run(base / "agent.py")
        base.chmod(0o711)
        with pytest.raises(LcapError) as closed_agent:
            run(private / "agent.py")
        assert store.fetchall("SELECT count(*) FROM episodes")[0][0] == 0
        assert not (base / "run" / "round-0").exists()
        result = run(base / "agent.py")
        status = store.fetchall("SELECT status, error FROM episodes")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    first, second = str(closed_run_dir.value), str(closed_agent.value)
    assert f"cannot enter {base} " in first and f"chmod o+x {base}" in first and "--run-dir" in first, first
    assert f"cannot enter {private} " in second and f"chmod o+x {private}" in second, second
    assert "\n" not in first + second
    assert result.failed == 0 and status == [("ok", None)], status


PROXY_AGENT = r"""
import json, os, sys, urllib.request
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
req = urllib.request.Request("http://api.openai.com/v1/chat/completions", body, {"Content-Type": "application/json"})
json.load(urllib.request.urlopen(req, timeout=30))
visible = [os.path.join(d, n) for d, _, names in os.walk(os.environ["LCAP_HOME"]) for n in names]
try:
    open(sys.argv[1], "w").write("escaped")
    wrote = True
except OSError:
    wrote = False
print(json.dumps({"visible": visible, "wrote": wrote, "copied": sorted(os.listdir("."))}))
"""


def test_lcap_proxy_runs_its_command_in_a_sandbox(fake_llm):
    """`lcap proxy --sandbox -- CMD`: CMD in a copy of the current folder (lcap's home and the store left out),
    its LLM call captured, nothing outside written, lcap's home not visible."""
    fake_llm.reset()
    base = Path(tempfile.mkdtemp(prefix="lcap-sandbox-proxy-"))
    try:
        base.chmod(0o755)
        (base / "agent.py").write_text(PROXY_AGENT)
        home = base / "home"
        env = {**os.environ, "LCAP_HOME": str(home)}
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy"):
            env.pop(name, None)
        lcap = str(Path(sys.executable).parent / "lcap")
        argv = [lcap, "proxy", "--sandbox", "--upstream", fake_llm.url, "--db", str(base / "lcap.duckdb")]
        argv += ["--", SYSTEM_PYTHON, "agent.py", str(base / "outside.txt")]
        run = subprocess.run(argv, cwd=base, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert report == {"visible": [], "wrote": False, "copied": ["agent.py"]}
        assert not (base / "outside.txt").exists()
        assert Store(base / "lcap.duckdb").fetchall("SELECT count(*) FROM turns")[0][0] == 1
        assert not list(Path(tempfile.gettempdir()).glob("lcap-sandbox-*/work"))  # the workspace is gone
    finally:
        shutil.rmtree(base, ignore_errors=True)
