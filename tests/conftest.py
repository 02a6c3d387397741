"""Shared test set-up: each stage keeps its fixtures in its own module (loaded below as pytest plugins).

The tests sit in three tiers, one folder each, and carry their folder's marker (`-m unit`, `-m "not e2e"`):
tests/unit (in-process), tests/integration (processes and servers), tests/e2e (vLLM, training, loops, Ray).
Under pytest-xdist (`-n N --dist loadgroup`, as scripts/test.sh runs the suite) the tests that share a costly
session fixture, or a resource only one of them may hold at a time, run on one worker, one after another (their
`xdist_group`); the others spread over the workers."""

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
    """The worker-sharing group of a test: one vLLM server per run, Ray clusters one at a time, network namespaces
    one at a time; None for a test that may run beside any other."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if "vllm_server" in fixtures:
        return "vllm"
    if "ray_cluster" in fixtures or hasattr(getattr(item, "module", None), "ray_head"):
        return "ray"
    if "node_modules" in fixtures:
        return "node"
    if item.path.name == "test_capture_transparent.py":
        return "netns"
    return None


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: a test of tests/{tier}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name in TIERS:
            item.add_marker(item.path.parent.name)
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
