"""Which processes a loopback TCP connection comes from.

A JVM cannot present proxy credentials (`capture/reach/jvm.py`), so each episode gives it a loopback port
of its own (`Front.listen_episode`). Any local process can reach a loopback port; this port serves
only the agent's own processes (the child lcap started and its descendants), found through /proc:
the connecting socket's inode in /proc/net/tcp, then which of those processes holds it. Linux only;
elsewhere nothing is admitted and JVM agents need `--serve`'s credentials instead.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def _hex(address: tuple[str, int], v6: bool = False) -> str:
    """An IPv4 address and port as /proc/net/tcp writes them (the address in host byte order, little-endian), or
    as /proc/net/tcp6 writes it IPv4-mapped (a dual-stack client's socket, the JVM's)."""
    mapped = "0000000000000000FFFF0000" if v6 else ""
    return f"{mapped}{socket.inet_aton(address[0])[::-1].hex().upper()}:{address[1]:04X}"


def socket_inode(own: tuple[str, int], peer: tuple[str, int], tables: str = "/proc/net/tcp") -> int | None:
    """The inode of the TCP socket whose own IPv4 address is `own` and whose peer is `peer`, if it is listed (an
    IPv6 socket with IPv4-mapped addresses included)."""
    for table, v6 in ((tables, False), (tables + "6", True)):
        want = (_hex(own, v6), _hex(peer, v6))
        for fields in tcp_table(table):
            if len(fields) > 9 and (fields[1], fields[2]) == want:
                return int(fields[9]) or None
    return None


def tcp_table(table: str) -> list[list[str]]:
    """The rows of a /proc/net/tcp-style table, split into fields; none when it cannot be read."""
    try:
        lines = Path(table).read_text().splitlines()[1:]
    except OSError:
        return []
    return [line.split() for line in lines]


def descendants(root: int) -> set[int]:
    """`root` and every process under it (by their parent ids in /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(name))
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def holds_socket(pids: set[int], inode: int) -> bool:
    target = f"socket:[{inode}]"
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return True
            except OSError:
                continue
    return False


def from_tree(root: int, listener: tuple[str, int], peer: tuple[str, int]) -> bool:
    """Whether the connection from `peer` to our `listener` was made by `root` or a process under it."""
    inode = socket_inode(peer, listener)
    return inode is not None and holds_socket(descendants(root), inode)
