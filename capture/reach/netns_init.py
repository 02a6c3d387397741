"""The first moments of a `--transparent` agent: new namespaces, set up, then the agent itself (exec, same pid).

lcap starts `python -I -S netns_init.py FD -- AGENT...` (capture/reach/netns.py); this file imports only the
standard library, so it starts fast and reads nothing the agent's working directory holds. It reads
its set-up from the socket FD, then:

1. makes a network and a mount namespace of its own (and, without root, a user namespace that maps
   the user's own ids, so the agent keeps them);
2. brings up `lo` with a default route over it (every destination is routed, so netfilter sees it),
   and loads the rules lcap wrote with `iptables-restore`: every TCP connection and every DNS query
   goes to the listeners made in step 3, other UDP leaving the namespace is refused;
3. makes those listeners, a TCP one and a UDP one on the namespace's loopback, and hands them to lcap
   over FD (SCM_RIGHTS): lcap serves them, and whatever arrives on them is this episode's;
4. binds lcap's trust bundle over the system's CA bundle paths, read-only, in the mount namespace;
5. asks to be killed with lcap (PR_SET_PDEATHSIG), closes FD and execs the agent.

Nothing is set up outside the new namespaces: they, their rules and their mounts end with the last
process in them. Any failure is one line on stderr and exit code `SETUP_FAILED`, also sent to lcap.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys

SETUP_FAILED = 125  # as env(1), timeout(1) and unshare(1): the command itself never ran
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs flags of the mount that a read-only remount must keep (a user namespace may not drop them)
KEPT_FLAGS = ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME))
PR_SET_PDEATHSIG, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 1, 47, 2
CAP_NET_ADMIN, CAP_NET_RAW = 12, 13
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
RTM_NEWROUTE, NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE, NLMSG_ERROR = 24, 1, 4, 0x200, 0x400, 2
RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_LINK, RTN_UNICAST, RTA_OIF, RTA_PREFSRC = 254, 3, 253, 1, 4, 7

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def enter_namespaces(rootless: bool) -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET | CLONE_NEWNS | (CLONE_NEWUSER if rootless else 0)
    _check(libc.unshare(flags), "unshare")
    if rootless:  # the agent keeps its own ids; this process holds every capability inside until it execs
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")


def loopback_up() -> None:
    """`ip link set lo up` and `ip route add default dev lo src 127.0.0.1`, without needing the `ip` program."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))
    oif = struct.pack("HHI", 8, RTA_OIF, socket.if_nametoindex("lo"))
    # from 127.0.0.1 (else from 0.0.0.0: a redirected reply would not be translated back to where the agent sent)
    oif += struct.pack("HH", 8, RTA_PREFSRC) + socket.inet_aton("127.0.0.1")
    rtmsg = struct.pack("BBBBBBBBI", socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_LINK, RTN_UNICAST, 0)
    flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    body = rtmsg + oif
    message = struct.pack("IHHII", 16 + len(body), RTM_NEWROUTE, flags, 1, 0) + body
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as nl:  # NETLINK_ROUTE
        nl.send(message)
        answer = nl.recv(4096)
    kind = struct.unpack_from("IHHII", answer)[1]
    error = struct.unpack_from("i", answer, 16)[0] if kind == NLMSG_ERROR else 0
    if error:
        raise SetupError(f"default route over lo: {os.strerror(-error)}")


def _ambient_net_admin() -> None:
    """In the forked `iptables-restore` of a rootless set-up: keep CAP_NET_ADMIN across its exec (as a
    non-root id, exec would drop every capability)."""
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = ctypes.create_string_buffer(24)
    _check(libc.capget(header, data), "capget")
    words = list(struct.unpack("6I", data.raw))
    words[2] |= (1 << CAP_NET_ADMIN) | (1 << CAP_NET_RAW)  # inheritable, low word
    _check(libc.capset(header, struct.pack("6I", *words)), "capset")
    for cap in (CAP_NET_ADMIN, CAP_NET_RAW):
        _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), "ambient capability")


def load_rules(iptables_restore: str, rules: str, rootless: bool) -> None:
    try:
        done = subprocess.run(
            [iptables_restore],
            input=rules,
            text=True,
            capture_output=True,
            preexec_fn=_ambient_net_admin if rootless else None,  # safe: this process has one thread
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SetupError(f"{iptables_restore}: {exc}") from None
    if done.returncode != 0:
        why = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
        raise SetupError(f"iptables-restore: {why}")


def listeners() -> tuple[socket.socket, socket.socket]:
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1024)
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind(("127.0.0.1", 0))
    return tcp, dns


def bind_trust(mounts: list[list[str]]) -> None:
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private in the mount namespace")
    for source, target in mounts:
        _check(libc.mount(source.encode(), target.encode(), None, MS_BIND, None), f"bind {source} over {target}")
        kept = os.statvfs(target).f_flag
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        flags |= sum(ms for st, ms in KEPT_FLAGS if kept & st) | (MS_RELATIME if not kept & 1024 else 0)
        _check(libc.mount(None, target.encode(), None, flags, None), f"read-only {target}")


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: netns_init.py FD -- COMMAND...")
    channel = socket.socket(fileno=int(argv[1]))
    command = argv[3:]
    try:
        config = json.loads(channel.recv(1 << 20))
        enter_namespaces(config["rootless"])
        loopback_up()
        tcp, dns = listeners()
        rules = config["rules"].replace("{tcp}", str(tcp.getsockname()[1])).replace("{dns}", str(dns.getsockname()[1]))
        load_rules(config["iptables_restore"], rules, config["rootless"])
        bind_trust(config["mounts"])
        _check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "PR_SET_PDEATHSIG")
        if os.getppid() != config["parent"]:
            raise SetupError("lcap exited")
    except (SetupError, OSError, ValueError, KeyError) as exc:
        message = f"lcap: --transparent: cannot set up the agent's namespace: {exc}"
        try:
            channel.send(json.dumps({"error": message}).encode())
        except OSError:
            pass
        print(message, file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    ports = {"tcp": tcp.getsockname()[1], "dns": dns.getsockname()[1]}
    channel.sendmsg(
        [json.dumps(ports).encode()],
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("2i", tcp.fileno(), dns.fileno()))],
    )
    for sock in (channel, tcp, dns):
        sock.close()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"lcap: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv)
