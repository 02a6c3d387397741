"""`--sandbox`: each episode's agent in a bubblewrap sandbox of its own, whose only way out is lcap's capture proxy.

What one episode gets (`EpisodeSandbox`):

- a workspace: a tmpfs of `--sandbox-disk` MiB mounted at the episode's workdir and filled with the task's files
  before the agent starts, owned by the agent's user; or, where the task brings a directory (`Sandbox.lower`: a
  copy of it owned by the agent's user, made once per run), an overlay whose lower layer is that directory and
  whose upper layer is on such a tmpfs, so nothing is copied per episode and the disk limit holds alike; the agent
  starts in it, it alone is writable (besides a private $TMPDIR of the same size), and after the episode (verifier
  included) it is unmounted, copied to disk first with `--keep-workspaces`;
- the host's `nobody` with no capabilities (bubblewrap runs as root, then `setpriv` drops to nobody before the
  agent: root outside is not root inside), in mount, PID, IPC, UTS and network namespaces of its own: of the host
  only what `sandbox_view.py` shows (the system folders, what the command runs, `--sandbox-share`), read-only, with
  lcap's home, the store's files and the collect's run folder hidden in it (only lcap's CA bundle and the like are
  shown, under /run/lcap), a private /tmp, and only the sandbox's own processes in /proc;
- a network of its own loopback alone, where lcap listens on 127.0.0.1 at the proxy's port (a listener made in
  the namespace from outside, before the agent starts, and served by the proxy as this episode's: no credential
  enters the sandbox), so every LLM call is captured and nothing else leaves;
- a memory cgroup (`--sandbox-memory` MiB) and a pids cgroup (`--sandbox-pids`), cgroups v1; the wall time is
  collect's `--timeout`.

The verifier runs after the agent in a sandbox of its own (`Sandbox.verifier`): the same user, namespaces, hidden
paths and limits, no network at all, and a workspace that is an overlay over the agent's final one, where the
task's pristine test files are put before it starts; what it writes there is dropped with it.

bubblewrap blocks before running the agent (`--block-fd`) until lcap has put the sandbox in its cgroups and made
its listener. A limit reached is read back from the cgroups and the workspace after the agent ends
(`EpisodeSandbox.limits_reached`) and ends the episode with that reason. Needs root (cgroups, the workspace's
mount, the network namespace's listener) and `bwrap` (Debian's bubblewrap).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from lcap.capture.options import SandboxLimits
from lcap.capture.reach.agent_env import CA_VARS, PROXY_VARS, Child
from lcap.capture.reach.jvm import TRUST_STORE
from lcap.capture.reach.node_preload import PRELOAD, node_dir
from lcap.capture.sandbox_view import command_paths, folders, outside_system, python_paths, share_args, system_args
from lcap.capture.trust.ca import ca_dir
from lcap.config import LcapError, lcap_home

PACKAGE = "bubblewrap"
CGROUPS = Path("/sys/fs/cgroup")
GROUP = "lcap-sandbox"  # the parent of every episode's cgroups, in each controller
AGENT_UID = 65534  # the host's nobody
AS_AGENT = ("setpriv", f"--reuid={AGENT_UID}", f"--regid={AGENT_UID}", "--clear-groups")
NAMESPACES = ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try")
SHOWN = Path("/run/lcap")  # where the sandbox sees the few files of lcap's home it needs
CLONE_NEWNET = 0x40000000
MS_NODEV, MS_NOSUID = 4, 2
MNT_DETACH = 2
START_TIMEOUT = 30.0  # seconds bubblewrap may take to report its sandbox's first process
FULL_BYTES = 64 << 10  # a workspace with less free space than this was filled
JVM_PORT = re.compile(r"(-Dhttps?\.proxyPort=)\d+")


def missing() -> str | None:
    """Why `--sandbox` cannot run here, or None."""
    if shutil.which("bwrap") is None:
        return f"--sandbox needs bubblewrap: install the {PACKAGE} package (apt-get install {PACKAGE})"
    if shutil.which("setpriv") is None:
        return "--sandbox needs setpriv (util-linux)"
    if os.geteuid() != 0:
        return "--sandbox needs root (the sandbox's cgroups, its workspace's mount and its network listener)"
    for controller in ("memory", "pids"):
        if not os.access(CGROUPS / controller, os.W_OK):
            return f"--sandbox needs a writable cgroup v1 {controller} hierarchy at {CGROUPS / controller}"
    return None


def closed_folder(folders: Sequence[Path]) -> Path | None:
    """The first folder on the way to one of `folders` (each folder above it, then it) that the agent's user may not
    enter, or None. Asked of the kernel as that user, so that ACLs and group bits count as they will in the
    sandbox; the folders must exist."""
    way: dict[str, None] = {}
    for folder in folders:
        folder = Path(folder).resolve()
        for step in (*reversed(folder.parents), folder):
            way[str(step)] = None
    probe = 'for d; do [ -x "$d" ] || { printf %s "$d"; exit 0; }; done'
    try:
        done = subprocess.run(
            [*AS_AGENT, "--", "/bin/sh", "-c", probe, "sh", *way], capture_output=True, text=True, timeout=START_TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LcapError(f"--sandbox: cannot check which folders its user may enter: {exc}") from None
    if done.returncode != 0:
        raise LcapError(f"--sandbox: cannot check which folders its user may enter: {done.stderr.strip()}")
    return Path(done.stdout) if done.stdout else None


class SandboxedProxy(Protocol):
    """What a sandbox needs of the capture proxy (a `CaptureProxy`): its port, and a listener made in an episode's
    network served as that episode's."""

    port: int | None

    def serve_listener(self, episode_id: str, sock: socket.socket) -> AbstractContextManager[None]: ...


class Sandbox:
    """What the sandboxed episodes of a run share: their limits, the paths hidden from them, and the capture proxy
    that serves their listeners."""

    def __init__(
        self,
        limits: SandboxLimits,
        proxy: SandboxedProxy,
        hidden: Sequence[Path],
        hidden_files: Sequence[Path] = (),
        cache: Path | None = None,
    ) -> None:
        """`hidden`: folders shown empty inside (lcap's home always is); `hidden_files`: files absent inside, and
        every file beside them whose name starts with theirs (a DuckDB file's WAL); `cache`: where the workspaces'
        lower layers go (a hidden folder; default: a temporary folder), removed by `close`."""
        reason = missing()
        if reason:
            raise LcapError(reason)
        self.limits, self.proxy = limits, proxy
        self.hidden = sorted({Path(p).resolve() for p in (*hidden, lcap_home())}, key=lambda p: len(p.parts))
        self.hidden_files = [Path(p).resolve() for p in hidden_files]
        self.cache = cache
        self._lowers: dict[Path, Path] = {}
        self._lowers_dir: Path | None = None
        self._lowers_lock = threading.Lock()
        self._mount_points: list[Path] = []  # emptied workspace folders, removed by `close`
        _remove_orphan_cgroups()

    def lower(self, source: Path) -> Path:
        """The lower layer of an overlay workspace over `source`: a copy owned by the agent's user (an overlay's
        files keep their owner, and the agent must be able to change them), made on first use and shared by every
        episode of this sandbox over the same source."""
        source = Path(source).resolve()
        with self._lowers_lock:
            if source not in self._lowers:
                if self._lowers_dir is None:
                    if self.cache is not None:
                        self.cache.mkdir(parents=True, exist_ok=True)
                    self._lowers_dir = Path(tempfile.mkdtemp(prefix=".lcap-lowers-", dir=self.cache))
                copy = self._lowers_dir / str(len(self._lowers))
                shutil.copytree(source, copy, symlinks=True)
                _chown_tree(copy)
                self._lowers[source] = copy
            return self._lowers[source]

    def close(self) -> None:
        """Remove the lower layers and the workspaces' mount points (after the last episode's workspace is
        unmounted)."""
        with self._lowers_lock:
            if self._lowers_dir is not None:
                shutil.rmtree(self._lowers_dir, ignore_errors=True)
            self._lowers, self._lowers_dir = {}, None
            for folder in self._mount_points:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            self._mount_points = []

    def remove_later(self, mount_point: Path) -> None:
        """An episode's unmounted (empty) workspace folder, removed by `close`, not now: another episode's sandbox
        that binds a folder above it (the host's /) holds a copy of its mount, and removing the folder detaches
        that copy, which fails that sandbox's set-up if it comes while bubblewrap walks its mounts."""
        with self._lowers_lock:
            self._mount_points.append(mount_point)

    def mounts(self, shares: Sequence[Path]) -> list[str]:
        """bubblewrap's arguments that hide what the agent must not see in the `shares` it is shown: a hidden
        file's folder becomes a tmpfs with every other entry bound back (as it was when the episode started), then
        each hidden folder a tmpfs."""
        args: list[str] = []
        for file in self.hidden_files:
            folder = file.parent
            if any(folder.is_relative_to(h) for h in self.hidden) or not folder.is_dir():
                continue
            if not any(folder.is_relative_to(s) for s in shares):
                continue
            args += ["--tmpfs", str(folder)]
            for entry in sorted(os.listdir(folder)):
                if not entry.startswith(file.name):
                    args += ["--ro-bind", str(folder / entry), str(folder / entry)]
        for path in self.hidden:
            if path.is_dir() and any(path.is_relative_to(s) for s in shares):
                args += ["--tmpfs", str(path)]
        return args

    def episode(self, episode_id: str, workdir: Path) -> EpisodeSandbox:
        return EpisodeSandbox(self, episode_id, workdir)

    def verifier(self, episode_id: str, final: Path, folder: Path, shown: Sequence[Path] = ()) -> EpisodeSandbox:
        """A fresh sandbox for an episode's verifier: its workspace (mounted at `folder`, seen inside at `final`'s
        path) an overlay over the agent's `final` workspace, no network at all, this Python's installation and
        `shown` files readable. `prepare(lower=final)` it like an episode's."""
        return EpisodeSandbox(self, f"{episode_id}-verify", folder, inside=final, network=False, shown=shown)


class EpisodeSandbox:
    """One episode's sandbox: `prepare` (the workspace, before the task's files go in), `own` (after), `child`
    (how to start the agent in it), `limits_reached` (after it ended), `close` (always)."""

    def __init__(
        self,
        sandbox: Sandbox,
        episode_id: str,
        workdir: Path,
        *,
        inside: Path | None = None,
        network: bool = True,
        shown: Sequence[Path] = (),
    ) -> None:
        """`workdir`: where the workspace is mounted here; `inside`: where the sandbox sees it (default: there);
        `network`: a listener of the proxy's in its network namespace (else none: only a loopback nothing
        listens on); `shown`: files shown read-only at their own paths."""
        self.sandbox, self.limits, self.episode_id = sandbox, sandbox.limits, episode_id
        self.workdir = Path(workdir).resolve()
        self.inside = Path(inside).resolve() if inside is not None else self.workdir
        self.network, self.shown = network, [Path(p) for p in shown]
        self.tmp = self.inside.parent / "tmp"
        self.cgroups = [CGROUPS / c / GROUP / f"{episode_id}-{os.getpid()}" for c in ("memory", "pids")]
        self.mounted = False
        self.layer: Path | None = None  # an overlay workspace's tmpfs (its upper layer and overlayfs' work folder)
        self.listening = contextlib.ExitStack()
        self.pipes: list[int] = []

    # --- before the agent ---------------------------------------------------------------------

    def prepare(self, lower: Path | None = None) -> None:
        """The workspace at the (empty) workdir: a tmpfs, or an overlay over `lower` (a folder the agent's user
        owns: `Sandbox.lower`) whose upper layer is such a tmpfs; and the cgroups."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.inside == self.workdir:
            self.tmp.mkdir(exist_ok=True)
        size = self.limits.disk_mb << 20
        options = f"size={size},mode=0755,uid={AGENT_UID},gid={AGENT_UID}"
        if lower is None:
            _mount("tmpfs", str(self.workdir), "tmpfs", MS_NODEV | MS_NOSUID, options)
        else:
            self.layer = self.workdir.with_name(self.workdir.name + ".layer")
            self.layer.mkdir()
            _mount("tmpfs", str(self.layer), "tmpfs", MS_NODEV | MS_NOSUID, options)
            (self.layer / "upper").mkdir()
            (self.layer / "work").mkdir()
            os.chown(self.layer / "upper", AGENT_UID, AGENT_UID)
            layers = f"lowerdir={Path(lower).resolve()},upperdir={self.layer / 'upper'},workdir={self.layer / 'work'}"
            try:
                _mount("overlay", str(self.workdir), "overlay", MS_NODEV | MS_NOSUID, layers)
            except LcapError:
                _umount(str(self.layer))
                self.layer.rmdir()
                self.layer = None
                raise
        self.mounted = True
        memory, pids = self.cgroups
        for group in self.cgroups:
            group.mkdir(parents=True, exist_ok=True)
        (memory / "memory.limit_in_bytes").write_text(str(self.limits.memory_mb << 20))
        with contextlib.suppress(OSError):  # absent without swap accounting
            (memory / "memory.memsw.limit_in_bytes").write_text(str(self.limits.memory_mb << 20))
        (pids / "pids.max").write_text(str(self.limits.pids))

    def own(self) -> None:
        """The task's files, now in the workspace, become the agent's (an overlay's: those in its upper layer, the
        lower one being the agent's already; changing the owner of the whole would copy it up)."""
        _chown_tree(self.layer / "upper" if self.layer is not None else self.workdir)

    def child(self, argv: Sequence[str], env: Mapping[str, str], port: int) -> tuple[Child, dict[str, str]]:
        """How to start `argv` in the sandbox (bubblewrap, blocked until `started` has set it up) and its
        environment: the proxy variables point at the sandbox's own listener, without credentials."""
        env = dict(env)
        if self.network:
            inside = f"http://127.0.0.1:{port}"
            for name in PROXY_VARS:
                env[name] = inside
            if "JAVA_TOOL_OPTIONS" in env:  # the JVM's port (an episode port of the host's loopback): the listener's
                env["JAVA_TOOL_OPTIONS"] = JVM_PORT.sub(rf"\g<1>{port}", env["JAVA_TOOL_OPTIONS"])
            env["LCAP_PROXY_URL"] = inside
        env["TMPDIR"] = str(self.tmp)
        env["HOME"] = str(self.inside)
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        self.pipes = [info_r, info_w, block_r, block_w]
        args = ["bwrap", *NAMESPACES, "--die-with-parent", "--new-session", *system_args()]
        args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/run", "--perms", "0755", "--dir", str(SHOWN)]
        args += ["--perms", "1777", "--size", str(self.limits.disk_mb << 20), "--tmpfs", "/tmp"]
        behind = [p for p in self.shown if any(p.resolve().is_relative_to(h) for h in self.sandbox.hidden)]
        shares = [*self.limits.shares, *command_paths(argv, env), *(p for p in self.shown if p not in behind)]
        if not self.network:  # the verifier: this Python, wherever it is installed
            shares += python_paths()
        shares = outside_system(shares)
        args += share_args(shares)
        args += self.sandbox.mounts(shares)
        args += folders(Path("/"), self.inside)  # bubblewrap would make the folders down to the workspace root's alone
        for path in behind:  # a file of the episode's own (in the hidden run folder): shown over the hiding
            args += folders(Path("/"), path) + ["--ro-bind", str(path), str(path)]
        for outside, inside in _shown(env).items():
            args += ["--ro-bind", outside, inside]
            for name, value in env.items():
                if outside in value:
                    env[name] = value.replace(outside, inside)
        args += ["--bind", str(self.workdir), str(self.inside)]
        args += ["--perms", "1777", "--size", str(self.limits.disk_mb << 20), "--tmpfs", str(self.tmp)]
        args += ["--chdir", str(self.inside), "--info-fd", str(info_w), "--block-fd", str(block_r), "--"]
        args += [*AS_AGENT, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        return Child([*args, "--", *argv], env, (info_w, block_r), on_start=lambda proc: self.started(proc, port)), env

    def started(self, proc: subprocess.Popen, port: int) -> None:
        """bubblewrap runs, its sandbox blocked: the sandbox into its cgroups, lcap's listener into its network,
        then the agent may start."""
        info_r, info_w, block_r, block_w = self.pipes
        os.close(info_w)
        os.close(block_r)
        try:
            pid = _child_pid(info_r)
            for group in self.cgroups:
                (group / "cgroup.procs").write_text(str(pid))
            if self.network:
                sock = listen_in(pid, port)
                self.listening.enter_context(self.sandbox.proxy.serve_listener(self.episode_id, sock))
            os.write(block_w, b"1")
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            os.close(info_r)
            os.close(block_w)
            self.pipes = []

    # --- after the agent ----------------------------------------------------------------------

    def limits_reached(self) -> dict[str, Any]:
        """The limits the agent ran into: {"memory": MiB, "pids": N, "disk": MiB}, each only if reached."""
        memory, pids = self.cgroups
        out: dict[str, Any] = {}
        oom = _fields(memory / "memory.oom_control")
        if oom.get("oom_kill", 0) > 0 or (oom.get("oom_kill") is None and _int(memory / "memory.failcnt") > 0):
            out["memory"] = self.limits.memory_mb
        if _fields(pids / "pids.events").get("max", 0) > 0:
            out["pids"] = self.limits.pids
        if self.mounted:
            st = os.statvfs(self.workdir)
            if st.f_bavail * st.f_frsize < FULL_BYTES:
                out["disk"] = self.limits.disk_mb
        return out

    def close(self) -> None:
        """Stop listening, end what is left in the cgroups and remove them, and unmount the workspace (copied to
        disk first with --keep-workspaces; else it is gone)."""
        self.listening.close()
        for fd in self.pipes:
            with contextlib.suppress(OSError):
                os.close(fd)
        for group in self.cgroups:
            _remove_cgroup(group)
        if not self.mounted:
            return
        keep = self.limits.keep_workspaces and self.network  # a verifier's view of the workspace is never kept
        kept = self.workdir.with_name(self.workdir.name + ".kept")
        if keep:
            shutil.copytree(self.workdir, kept, symlinks=True)
        _umount(str(self.workdir))
        if self.layer is not None:
            _umount(str(self.layer))
            self.sandbox.remove_later(self.layer)
            self.layer = None
        self.mounted = False
        if keep:  # moved into the (now empty) mount point, which stays: see `Sandbox.remove_later`
            for entry in os.listdir(kept):
                shutil.move(kept / entry, self.workdir / entry)
            kept.rmdir()
        else:
            self.sandbox.remove_later(self.workdir)


def limits_text(reached: Mapping[str, Any]) -> str:
    """`EpisodeSandbox.limits_reached` as the reason an episode ended with."""
    names = {"memory": "memory limit ({} MiB)", "pids": "process limit ({})", "disk": "disk limit ({} MiB)"}
    return "sandbox: " + ", ".join(names[k].format(v) for k, v in reached.items()) + " reached"


def _shown(env: Mapping[str, str]) -> dict[str, str]:
    """What of lcap's home the agent needs, outside -> inside: its CA bundle (never the CA's key), the JVM's trust
    store, Node's preload and its packages; under /run/lcap, reachable whatever the folders above lcap's home allow."""
    paths = {env[name] for name in CA_VARS if name in env}
    paths |= {str(ca_dir() / TRUST_STORE), str(node_dir() / "node_modules"), str(PRELOAD)}
    return {p: str(SHOWN / Path(p).name) for p in sorted(paths) if os.path.exists(p)}


def _chown_tree(top: Path) -> None:
    for root, dirs, files in os.walk(top):
        for name in (root, *(os.path.join(root, n) for n in (*dirs, *files))):
            os.lchown(name, AGENT_UID, AGENT_UID)


def release_mounts(folder: Path) -> None:
    """Unmount what a killed lcap left mounted under `folder` (an episode's workspace), so it can be removed."""
    prefix = str(Path(folder).resolve()) + "/"
    with contextlib.suppress(OSError):
        points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
            with contextlib.suppress(LcapError):
                _umount(point)


def _remove_orphan_cgroups() -> None:
    """Episode cgroups whose lcap process is gone (killed before it could remove them)."""
    for controller in ("memory", "pids"):
        for group in (CGROUPS / controller / GROUP).glob("*-*"):
            pid = group.name.rsplit("-", 1)[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _remove_cgroup(group, wait=0.5)


def _child_pid(fd: int) -> int:
    """The sandbox's first process, from bubblewrap's --info-fd JSON."""
    data = b""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            return int(json.loads(data)["child-pid"])
        except ValueError:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise LcapError("bubblewrap did not start its sandbox in time")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise LcapError("bubblewrap ended before its sandbox started (see the episode's stderr.txt)")
        data += chunk


def listen_in(pid: int, port: int, timeout: float = START_TIMEOUT) -> socket.socket:
    """A listener on 127.0.0.1:`port` in `pid`'s network namespace: made on a thread of its own that enters the
    namespace and ends there (a thread's network namespace is its own; lcap's other threads stay outside).
    bubblewrap reports its sandbox's pid while the sandbox may still be setting its loopback up (the interface up,
    127.0.0.1 not on it yet): until then (at most `timeout` seconds) the bind is refused, and tried again."""
    made: list[socket.socket | BaseException] = []

    def enter() -> None:
        try:
            ns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                if _libc().setns(ns, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(ns)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    made.append(socket.create_server(("127.0.0.1", port), backlog=512))
                    return
                except OSError as exc:
                    if exc.errno != errno.EADDRNOTAVAIL or time.monotonic() > deadline:
                        raise
                time.sleep(0.01)
        except BaseException as exc:
            made.append(exc)

    thread = threading.Thread(target=enter, name="lcap-sandbox-net")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise LcapError(f"cannot listen in the sandbox's network: {made[0]}")
    return made[0]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc().mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        raise LcapError(f"cannot mount the sandbox's workspace at {target}: {os.strerror(ctypes.get_errno())}")


def _umount(target: str) -> None:
    if _libc().umount2(target.encode(), MNT_DETACH) != 0:
        raise LcapError(f"cannot unmount the sandbox's workspace at {target}: {os.strerror(ctypes.get_errno())}")


def _fields(path: Path) -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
    return out


def _int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def _remove_cgroup(group: Path, wait: float = 5.0) -> None:
    """Remove an episode's cgroup once its processes are gone, killing any left (the sandbox's PID namespace ends
    them with its first process, but they are reaped a moment later)."""
    deadline = time.monotonic() + wait
    while group.exists():
        try:
            group.rmdir()
            return
        except OSError:
            pass
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
