"""`--transparent`: each agent runs in network and mount namespaces of its own, where every TCP connection it
makes is redirected to lcap, whatever the agent thinks of proxies.

An agent's start goes through `netns_init.py` (which runs inside, then becomes the agent): it makes
the namespaces, routes everything over `lo`, loads lcap's iptables rules there, makes two listeners
on the namespace's loopback (TCP, and UDP for DNS), binds lcap's trust bundle over the system CA
paths, and sends the listeners to lcap over a socket pair. lcap serves them from its own event
loop: the TCP one with the front (`Front.listen_episode`, which reads each connection's original
destination with SO_ORIGINAL_DST: `original_destination` in capture/proxy/connections.py), the UDP
one with lcap's DNS (capture/reach/dns.py). A listener lives in one namespace only, so whatever
arrives on it is that episode's: attribution needs no credentials and cannot be claimed from
anywhere else.

What the rules do inside (nothing is set on the host): DNS queries go to lcap; TCP to the host's
loopback ports that were listening when the episode started goes to lcap, which passes it to the
host's service unstored; other loopback traffic stays in the namespace (an agent's own servers);
every other TCP connection goes to lcap; UDP leaving the namespace is refused, so QUIC falls back
to TCP. Only IPv4 is routed.

Nothing outlives the agent: the namespaces, their rules and their mounts belong to its processes
and end with the last of them; the listeners lcap holds end with the episode, or with lcap (the
agent is killed with lcap, PR_SET_PDEATHSIG); no file, mount or rule is made on the host.
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import CancelledError
from pathlib import Path
from typing import TYPE_CHECKING, Any

import certifi

from lcap.capture.reach.dns import NamespaceDns
from lcap.capture.reach.peers import tcp_table
from lcap.config import LcapError

if TYPE_CHECKING:
    from lcap.capture.reach.dns import Resolver
    from lcap.capture.reach.listeners import EpisodeListeners

log = logging.getLogger("lcap.capture")

INIT = Path(__file__).with_name("netns_init.py")
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
RESTORE_PROGRAMS = ("iptables-restore", "iptables-nft-restore", "iptables-legacy-restore")
START_TIMEOUT = 30.0  # seconds an agent's namespace may take to hand its listeners over
CLOSE_TIMEOUT = 5.0  # seconds the proxy's loop may take to let go of an ended episode's sockets
CHECK_EPISODE = "lcap-check"  # the episode of the namespace `Namespaces.check` sets up at start

# System CA bundles (PEM) and JVM trust stores, where each distribution keeps them; /etc/ssl/certs itself is a
# directory lcap mirrors (Debian, Ubuntu, Alpine: the bundle, the hashed links OpenSSL looks up, Java's cacerts).
SYSTEM_CERTS = Path("/etc/ssl/certs")
PEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine, Gentoo
    "/etc/pki/tls/certs/ca-bundle.crt",  # RHEL, Fedora, CentOS
    "/etc/pki/tls/cert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/cert.pem",  # Alpine, OpenSSL's default on several
    "/etc/ssl/ca-bundle.pem",  # openSUSE
    "/etc/ca-certificates/extracted/tls-ca-bundle.pem",  # Arch
)
BUNDLE_NAMES = frozenset(("ca-certificates.crt", "ca-bundle.crt", "ca-bundle.trust.crt", "tls-ca-bundle.pem"))
JVM_STORES = (
    "/etc/ssl/certs/java/cacerts",  # Debian, Ubuntu
    "/etc/pki/ca-trust/extracted/java/cacerts",  # RHEL, Fedora
    "/etc/pki/java/cacerts",
)
JVM_HOMES = ("/usr/lib/jvm/*", "/usr/java/*", "/opt/java/*", "/usr/local/openjdk-*", "/opt/java/openjdk")


# --- what the machine offers -----------------------------------------------------------------------------


def restore_program() -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return next((found for name in RESTORE_PROGRAMS if (found := shutil.which(name, path=path))), None)


def user_namespaces_allowed() -> bool:
    for path, off in (("/proc/sys/kernel/unprivileged_userns_clone", "0"), ("/proc/sys/user/max_user_namespaces", "0")):
        try:
            if Path(path).read_text().strip() == off:
                return False
        except OSError:
            continue
    return True


def missing() -> str | None:
    """What this machine lacks for `--transparent`, in words; None when nothing is known to be missing."""
    if not sys.platform.startswith("linux"):
        return "Linux (network namespaces)"
    if restore_program() is None:
        return "iptables (iptables-restore; `apt-get install iptables`, or scripts/setup.sh)"
    if os.geteuid() != 0 and not user_namespaces_allowed():
        return "root, or unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
    return None


def host_loopback_ports() -> list[int]:
    """TCP ports the host listens on that its loopback reaches (bound to 127.x, ::1 or a wildcard address)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for fields in tcp_table(table):
            if len(fields) < 4 or fields[3] != "0A":  # LISTEN
                continue
            address, _, port = fields[1].rpartition(":")
            if _loopback_reachable(address):
                ports.add(int(port, 16))
    return sorted(ports)


def _loopback_reachable(hex_address: str) -> bool:
    if len(hex_address) == 8:  # IPv4, little-endian
        return hex_address == "00000000" or hex_address.endswith("7F")
    if set(hex_address) == {"0"}:
        return True
    words = [hex_address[i : i + 8] for i in range(0, 32, 8)]
    v4_mapped = words[:2] == ["00000000", "00000000"] and words[2] == "FFFF0000"
    return words == ["00000000", "00000000", "00000000", "01000000"] or (v4_mapped and words[3].endswith("7F"))


def rules(loopback_ports: Sequence[int]) -> str:
    """The namespace's iptables rules; `{tcp}` and `{dns}` are the ports of its listeners (filled in inside)."""
    nat = ["-A OUTPUT -p udp --dport 53 -j REDIRECT --to-ports {dns}"]
    for i in range(0, len(loopback_ports), 15):  # multiport takes 15 ports a rule
        chunk = ",".join(str(p) for p in loopback_ports[i : i + 15])
        nat.append(f"-A OUTPUT -p tcp -d 127.0.0.0/8 -m multiport --dports {chunk} -j REDIRECT --to-ports {{tcp}}")
    nat += ["-A OUTPUT -d 127.0.0.0/8 -j RETURN", "-A OUTPUT -p tcp -j REDIRECT --to-ports {tcp}"]
    refuse = "-A OUTPUT -p udp ! -d 127.0.0.0/8 -j REJECT --reject-with icmp-port-unreachable"
    return "\n".join(
        ["*nat", ":OUTPUT ACCEPT [0:0]", *nat, "COMMIT", "*filter", ":OUTPUT ACCEPT [0:0]", refuse, "COMMIT", ""]
    )


# --- trust ----------------------------------------------------------------------------------------------


def certs_mirror(directory: Path, bundle: Path, store: Path, ca: Path) -> Path | None:
    """A copy of /etc/ssl/certs (links to the same certificates) where the bundle is lcap's, Java's `cacerts` is
    lcap's trust store and lcap's CA has its hashed link; made once per content, under `directory`."""
    if not SYSTEM_CERTS.is_dir() or SYSTEM_CERTS.is_symlink():
        return None
    entries = sorted(os.scandir(SYSTEM_CERTS), key=lambda e: e.name)
    digest = hashlib.sha256(f"{bundle}\0{store}\0".encode() + ca.read_bytes())
    for entry in entries:
        digest.update(f"{entry.name}\0{entry.stat(follow_symlinks=False).st_mtime_ns}\0".encode())
    mirror = directory / f"certs-{digest.hexdigest()[:16]}"
    if mirror.is_dir():
        return mirror
    tmp = directory / f".certs-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for entry in entries:
        _mirror_entry(Path(entry.path), tmp / entry.name, bundle, store)
    subject_hash = _subject_hash(ca)
    if subject_hash:
        n = 0
        while (tmp / f"{subject_hash}.{n}").is_symlink():
            n += 1
        (tmp / f"{subject_hash}.{n}").symlink_to(ca)
    (tmp / "lcap-ca.pem").symlink_to(ca)
    try:
        tmp.rename(mirror)
    except OSError:  # another lcap made it first
        shutil.rmtree(tmp, ignore_errors=True)
    for old in directory.glob("certs-*"):  # earlier contents (the system's certificates changed)
        if old != mirror:
            shutil.rmtree(old, ignore_errors=True)
    for left in directory.glob(".certs-*.tmp"):  # a copy whose lcap was killed while it made it
        pid = left.name.split("-", 1)[1].removesuffix(".tmp")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(left, ignore_errors=True)
    return mirror


def _mirror_entry(source: Path, target: Path, bundle: Path, store: Path) -> None:
    if source.is_symlink():
        target.symlink_to(os.readlink(source))
    elif source.is_dir():
        target.mkdir()
        for inner in sorted(source.iterdir()):
            if inner.name == "cacerts":
                (target / "cacerts").symlink_to(store)
            elif inner.is_file() or inner.is_symlink():
                _mirror_entry(inner, target / inner.name, bundle, store)
    elif source.name in BUNDLE_NAMES:
        target.symlink_to(bundle)
    elif source.is_file():
        shutil.copy2(source, target)  # not a link: the original path is under the mount that hides it


def _subject_hash(ca: Path) -> str | None:
    """OpenSSL's subject hash of the CA (the name of its link in a hashed directory), if `openssl` is there."""
    program = shutil.which("openssl")
    if program is None:
        return None
    try:
        done = subprocess.run(
            [program, "x509", "-noout", "-subject_hash", "-in", str(ca)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    value = done.stdout.strip()
    return value if done.returncode == 0 and len(value) == 8 else None


def trust_mounts(bundle: Path, store: Path, mirror: Path | None, path: str | None) -> list[tuple[str, str]]:
    """(source, target) bind mounts that make the system's trust paths, as seen inside, include lcap's CA."""
    mounts: list[tuple[str, str]] = []
    seen: set[str] = set()
    covered = str(SYSTEM_CERTS.resolve()) + "/" if mirror is not None else None
    if mirror is not None:
        mounts.append((str(mirror), str(SYSTEM_CERTS)))

    def add(source: Path, target: str) -> None:
        real = os.path.realpath(target)
        if real in seen or not os.path.isfile(real) or (covered and real.startswith(covered)):
            return
        if real in (os.path.realpath(bundle), os.path.realpath(store)):
            return
        seen.add(real)
        mounts.append((str(source), real))

    defaults = ssl.get_default_verify_paths()
    for target in (*PEM_BUNDLES, defaults.openssl_cafile, *_certifi_bundles(path)):
        add(bundle, target)
    for target in (*JVM_STORES, *_jdk_stores(path)):
        add(store, target)
    return mounts


def _certifi_bundles(path: str | None) -> list[str]:
    """certifi's bundle in lcap's own environment and in the Python environments on the agent's PATH."""
    found = [certifi.where()]
    for directory in (path or "").split(os.pathsep):
        if directory:
            for packages in ("site-packages", "dist-packages"):
                found += glob.glob(os.path.join(directory, "..", "lib", "python3*", packages, "certifi", "cacert.pem"))
    return found


def _jdk_stores(path: str | None) -> list[str]:
    homes = [h for pattern in JVM_HOMES for h in glob.glob(pattern)]
    java = shutil.which("java", path=path)
    if java:
        homes.append(str(Path(os.path.realpath(java)).parent.parent))
    if os.environ.get("JAVA_HOME"):
        homes.append(os.environ["JAVA_HOME"])
    return [os.path.join(home, sub, "security", "cacerts") for home in homes for sub in ("lib", "jre/lib")]


# --- one namespace per episode ----------------------------------------------------------------------------


class Namespaces:
    """Starts agents in namespaces of their own and serves their listeners (one proxy's)."""

    def __init__(
        self,
        front: EpisodeListeners,
        resolver: Resolver,
        loop: asyncio.AbstractEventLoop,
        *,
        bundle: Path,
        store: Path,
        mirror: Path | None,
    ) -> None:
        self.front, self.resolver, self.loop = front, resolver, loop
        self.bundle, self.store, self.mirror = bundle, store, mirror
        program = restore_program()
        if program is None:
            raise LcapError("--transparent needs iptables-restore")
        self.program = program
        self.rootless = os.geteuid() != 0
        self.failed = 0  # agents whose namespace could not be set up

    def check(self) -> None:
        """Set up one namespace for `true`, as an agent's would be: a one-line LcapError saying why it cannot be."""
        with self.launch(CHECK_EPISODE, os.environ.get("PATH")) as launch:
            argv = launch.argv(["true"])
            try:
                done = subprocess.run(
                    argv, pass_fds=launch.pass_fds, capture_output=True, text=True, timeout=START_TIMEOUT
                )
            except subprocess.TimeoutExpired:
                raise LcapError(
                    f"--transparent: setting up a namespace took over {START_TIMEOUT:g} s; "
                    "the default mode (without --transparent) still works"
                ) from None
            if done.returncode != 0:
                why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit code {done.returncode}"
                why = why.removeprefix("lcap: --transparent: ")
                raise LcapError(f"--transparent: {why}; the default mode (without --transparent) still works")
            if not launch.wait_ready(START_TIMEOUT):
                raise LcapError(
                    "--transparent: lcap cannot serve a namespace's listeners; the default mode still works"
                )

    def launch(self, episode: str, path: str | None) -> Launch:
        config = {
            "rootless": self.rootless,
            "iptables_restore": self.program,
            "rules": rules(host_loopback_ports()),
            "mounts": trust_mounts(self.bundle, self.store, self.mirror, path),
            "parent": os.getpid(),
        }
        return Launch(self, episode, json.dumps(config).encode())


class Launch:
    """One agent's start in its namespaces: the command to run (with `pass_fds`), and its listeners once the
    namespace hands them over, served until `close` (the end of the episode)."""

    def __init__(self, namespaces: Namespaces, episode: str, config: bytes) -> None:
        self.namespaces = namespaces
        self.episode = episode
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ours.setblocking(False)
        self.ours.send(config)
        self.server: asyncio.AbstractServer | None = None
        self.dns: asyncio.DatagramTransport | None = None
        self.dns_protocol: NamespaceDns | None = None
        self._closed = False
        self._ready = asyncio.run_coroutine_threadsafe(self._receive(), namespaces.loop)

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.theirs.fileno(),)

    def argv(self, command: Sequence[str]) -> list[str]:
        return [sys.executable, "-I", "-S", str(INIT), str(self.theirs.fileno()), "--", *command]

    async def _receive(self) -> None:
        """Wait for the namespace's listeners (or its error), then serve them as this episode's."""
        loop = self.namespaces.loop
        try:
            message, fds, _, _ = await self._recv_fds()
        except OSError:
            return
        sockets = [socket.socket(fileno=fd) for fd in fds]
        served = False
        try:
            reply = json.loads(message) if message else {"error": "the agent's namespace ended before it was set up"}
            if "error" in reply:
                if self.episode != CHECK_EPISODE:
                    self.namespaces.failed += 1
                    log.warning("lcap: episode %s: %s", self.episode, reply["error"])
                return
            if len(sockets) != 2 or self._closed:
                return
            tcp, dns = sockets
            tcp.setblocking(False)
            dns.setblocking(False)
            self.server = await self.namespaces.front.listen_episode(self.episode, tcp, redirected=True)
            resolver = self.namespaces.resolver
            self.dns, self.dns_protocol = await loop.create_datagram_endpoint(lambda: NamespaceDns(resolver), sock=dns)
            served = True
            if self._closed:  # the episode ended while they were made: `close` did not find them all
                await self._close_listeners()
        except (ValueError, OSError) as exc:
            log.warning("lcap: episode %s: its namespace's listeners cannot be served: %s", self.episode, exc)
        finally:
            if not served:
                for sock in sockets:
                    sock.close()

    async def _recv_fds(self) -> tuple[bytes, list[int], int, Any]:
        loop = self.namespaces.loop
        while True:
            try:
                return socket.recv_fds(self.ours, 4096, 2)
            except BlockingIOError:
                pass
            waiter = loop.create_future()
            loop.add_reader(self.ours.fileno(), waiter.set_result, None)
            try:
                await waiter
            finally:
                if self.ours.fileno() >= 0:  # else `close` took it off the loop before it closed it
                    loop.remove_reader(self.ours.fileno())

    def wait_ready(self, timeout: float = START_TIMEOUT) -> bool:
        """Whether the listeners are served (or the namespace gave up) within `timeout` seconds."""
        try:
            self._ready.result(timeout)
        except Exception:
            return False
        return self.server is not None

    def close(self) -> None:
        """End the episode's listeners (connections already accepted go on) and the socket pair."""
        self._closed = True
        self.theirs.close()

        async def close() -> None:
            if not self._ready.done():
                self._ready.cancel()
            if self.ours.fileno() >= 0:  # the set-up may still wait to read it: take it off the loop, then close it
                self.namespaces.loop.remove_reader(self.ours.fileno())
                self.ours.close()
            await self._close_listeners()

        try:
            asyncio.run_coroutine_threadsafe(close(), self.namespaces.loop).result(2 * CLOSE_TIMEOUT)
        except (RuntimeError, TimeoutError, CancelledError):  # the proxy's loop is gone or stopping: so are its sockets
            self.ours.close()

    async def _close_listeners(self) -> None:
        """Close what of the listeners is made (again, harmlessly, for what was closed before)."""
        if self.server is not None:
            self.server.close()
        if self.dns is not None and self.dns_protocol is not None:
            self.dns.close()  # the socket closes on a later turn of the loop: the episode ends once it did
            await asyncio.wait_for(self.dns_protocol.closed.wait(), CLOSE_TIMEOUT)

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
