"""A pytest plugin that writes each test's wall time and CPU seconds, one JSON line per test, to find what a tier's
time goes to (docs/benchmarks.md, "The test suite's time"):

    PYTHONPATH=benchmarks LCAP_TEST_CPU_OUT=/tmp/cpu.jsonl .venv/bin/python -m pytest -p pytest_cpu -n 2 tests/e2e

`self` is the test process's own CPU (an in-process proxy, a trainer); `children` the CPU of the processes it started
and waited for (lcap commands, agents). Servers that outlive a test (a module's vLLM, a Ray cluster) count in neither:
process accounting (`accton`) or py-spy sees them. Each xdist worker appends to the one file; `worker` says which.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

OUT = os.environ.get("LCAP_TEST_CPU_OUT", "test-cpu.jsonl")


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    started, (own, children) = time.monotonic(), _cpu()
    yield
    own_after, children_after = _cpu()
    row = {
        "id": item.nodeid,
        "wall": round(time.monotonic() - started, 1),
        "self": round(own_after - own, 1),
        "children": round(children_after - children, 1),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
    }
    with open(OUT, "a") as out:
        out.write(json.dumps(row) + "\n")
