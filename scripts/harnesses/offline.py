#!/usr/bin/env python3
"""Run a command with no route out: a network namespace of its own where only chosen local ports answer.

    scripts/harnesses/offline.py --port 8000 -- lcap collect ... -- scripts/harnesses/codex.sh "{prompt}"

The command (and everything it starts: lcap's proxy, the harness, its side traffic) runs in a new network
namespace (`unshare --net`, root or user namespaces needed) with only a loopback interface. Each `--port`
of this machine's 127.0.0.1 (the policy server) is bridged in through a Unix socket, at the same address,
so `lcap serve`'s record stays right; anything else (api.openai.com, telemetry, update checks, DNS) fails
at once instead of reaching the internet. Exits with the command's exit code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

CHUNK = 1 << 16
MAX_BRIDGED = 256  # connections bridged at once per port


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy bytes from src to dst until src ends, then half-close dst."""
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def bridge(client: socket.socket, connect: Callable[[], socket.socket], slots: threading.BoundedSemaphore) -> None:
    try:
        with client, connect() as upstream:
            back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
            back.start()
            pump(client, upstream)
            back.join()
    except OSError:
        pass
    finally:
        slots.release()


def serve(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Accept forever; each connection is bridged on two threads, at most MAX_BRIDGED at once."""
    slots = threading.BoundedSemaphore(MAX_BRIDGED)
    while True:
        client, _ = listener.accept()
        if not slots.acquire(timeout=30):
            client.close()
            continue
        threading.Thread(target=bridge, args=(client, connect, slots), daemon=True).start()


def outer(ports: list[int], command: list[str]) -> int:
    """In this machine's namespace: a Unix socket per port that leads to 127.0.0.1:PORT, then the namespace."""
    if shutil.which("unshare") is None:
        sys.exit("offline.py: `unshare` (util-linux) is not installed")
    sockets = tempfile.mkdtemp(prefix="lcap-offline-")
    for port in ports:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(sockets, f"{port}.sock"))
        listener.listen(64)

        def connect(port: int = port) -> socket.socket:
            upstream = socket.create_connection(("127.0.0.1", port), timeout=30)
            upstream.settimeout(None)  # a policy server may think for minutes before its first byte
            return upstream

        threading.Thread(target=serve, args=(listener, connect), daemon=True).start()
    inner = [sys.executable, os.path.abspath(__file__), "--inner", sockets]
    inner += [f"--port={port}" for port in ports]
    child = subprocess.Popen(["unshare", "--net", "--", *inner, "--", *command])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    try:
        return child.wait()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def inner(sockets: str, ports: list[int], command: list[str]) -> int:
    """In the new namespace: loopback up, each port listening and bridged out, then the command."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for port in ports:
        listener = socket.create_server(("127.0.0.1", port), backlog=64)

        def connect(path: str = os.path.join(sockets, f"{port}.sock")) -> socket.socket:
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.connect(path)
            return unix

        threading.Thread(target=serve, args=(listener, connect), daemon=True).start()
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    return 128 - code if code < 0 else code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, action="append", default=[], help="a 127.0.0.1 port to bridge in")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    if args.inner:
        sys.exit(inner(args.inner, args.port, command))
    code = outer(args.port, command)
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
