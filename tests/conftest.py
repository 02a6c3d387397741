"""Shared test set-up: each stage keeps its fixtures in its own module (loaded below as pytest plugins).

The tests sit in three tiers, one folder each, and carry their folder's marker (`-m unit`, `-m "not e2e"`):
tests/unit (in-process), tests/integration (processes and servers), tests/e2e (vLLM, training, loops, Ray).
Under pytest-xdist (`-n N --dist loadgroup`, as scripts/test.sh runs the suite) each integration or end-to-end
file runs on one worker, one test after another (its `xdist_group`), and unit tests spread over the workers. A
session fixture is set up once per worker that needs it (at most one vLLM server per worker); every port is bound
as port 0 by whoever listens on it, and each worker has a temporary tree (and lcap home) of its own."""

import signal

import pytest

pytest_plugins = [
    "fixtures_vllm",
    "fixtures_capture",
    "fixtures_dataset",
    "fixtures_train",
    "fixtures_ui",
    "fixtures_ray",
    "fixtures_doctor",
]

TIERS = ("unit", "integration", "e2e")

# A suite started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored, and so
# would every lcap and agent it starts; several tests send SIGINT on purpose. A handler here makes
# the processes the tests start begin with SIGINT's default action, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def xdist_group(item: pytest.Item) -> str | None:
    """The worker-sharing group of a test: an integration or end-to-end test runs on the worker that runs the rest of
    its file (a module fixture, a store or cluster the file's tests share, is set up once); unit tests spread."""
    if item.path.parent.name in ("integration", "e2e"):
        return f"{item.path.parent.name}/{item.path.stem}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name in TIERS:
            item.add_marker(item.path.parent.name)
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
