"""The unit tier stays in-process: a test here that starts a child process or opens an inet socket fails."""

import socket
import subprocess

import pytest


class LeftTheProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def in_process_only(monkeypatch):
    def popen(self, args, *rest, **kwargs):
        raise LeftTheProcess(f"a unit test started a process ({args!r}): it belongs in tests/integration")

    def inet(method):
        def guarded(self, address, *rest):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                raise LeftTheProcess(f"a unit test used an inet socket ({address!r}): it belongs in tests/integration")
            return method(self, address, *rest)

        return guarded

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    for name in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, inet(getattr(socket.socket, name)))
