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


# What each e2e file costs in a whole run (seconds on two workers, from a whole e2e run's durations): scripts/test.sh
# hands files out in collection order (`--no-loadscope-reorder`), each to the first idle worker, and the phase ends
# when the slower worker does; the longest first leaves short files to even out the end. Only the order matters; a
# file not listed counts as long, so a new one never lands alone at the end.
E2E_SECONDS = {
    "test_train_loop.py": 349,
    "test_serve_replicas.py": 338,
    "test_real_model.py": 260,
    "test_dataset_ray_collect.py": 234,
    "test_train_distributed.py": 196,
    "test_loop_demo_tools.py": 173,
    "test_loop_live.py": 137,
    "test_harnesses.py": 126,
    "test_serve_ray.py": 89,
    "test_loop_async.py": 84,
    "test_loop_promote.py": 61,
    "test_serve_deploy.py": 55,
    "test_policy_route.py": 42,
    "test_loop_roles.py": 40,
    "test_train_mismatch.py": 39,
    "test_train_sft.py": 34,
    "test_loop_skip.py": 31,
    "test_dataset_e2e.py": 29,
    "test_train_grpo.py": 22,
    "test_serve_roles.py": 21,
    "test_coding_sandbox.py": 20,
    "test_loop_demo.py": 20,
    "test_capture_vllm.py": 19,
    "test_judge_vllm.py": 16,
    "test_serve_proxy.py": 12,
    "test_serve_merge.py": 9,
    "test_eval.py": 5,
    "test_train_roles.py": 4,
    "test_serve_vllm.py": 2,
    "test_doctor.py": 1,
}
UNLISTED_E2E_SECONDS = 120

# A suite started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored, and so
# would every lcap and agent it starts; several tests send SIGINT on purpose. A handler here makes
# the processes the tests start begin with SIGINT's default action, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name in TIERS:
            item.add_marker(item.path.parent.name)
        if item.path.parent.name == "unit" and item.get_closest_marker("serial"):
            # scripts/test.sh's serial phase runs alone and collects tests/integration only: collecting the unit tier
            # too (torch, transformers) would hold the whole machine for nothing, and a serial unit test would not run.
            raise pytest.UsageError(
                f"{item.nodeid}: a unit test cannot be marked serial (scripts/test.sh runs tests/integration's only)"
            )
    items.sort(key=_e2e_cost_first)  # stable: each file's tests, and the other tiers, keep their order


def _e2e_cost_first(item: pytest.Item) -> float:
    if item.path.parent.name != "e2e":
        return 0
    return -E2E_SECONDS.get(item.path.name, UNLISTED_E2E_SECONDS)
