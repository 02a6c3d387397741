"""Shared test set-up: each stage keeps its fixtures in its own module (loaded below as pytest plugins).

The tests sit in three tiers, one folder each, and carry their folder's marker (`-m unit`, `-m "not e2e"`):
tests/unit (in-process), tests/integration (processes and servers), tests/e2e (vLLM, training, loops, Ray).
Under pytest-xdist (`-n N --dist loadfile`, as scripts/test.sh runs the suite) each file runs on one worker, one
test after another. A session fixture is set up once per worker that needs it (at most one vLLM server per worker); every port is bound
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name in TIERS:
            item.add_marker(item.path.parent.name)
