"""A node's capture proxy that cannot start says why in one line (`lcap collect --ray` on real clusters:
tests/e2e/test_dataset_ray_collect.py)."""

from __future__ import annotations

import os


def test_a_node_proxy_that_cannot_start_says_why_in_one_line(tmp_path, monkeypatch, capture_home):
    """Whatever stops a node's capture proxy from starting (here a stand-in failure of the proxy's start) is what
    its episodes report, one line, instead of a dead actor's traceback."""
    from lcap.capture.options import ProxyOptions
    from lcap.capture.proxy.server import CaptureProxy
    from lcap.dataset.collect.node_proxies import NodeConfig, NodeProxy

    monkeypatch.setenv("LCAP_HOME", str(capture_home))

    def refuse(self) -> None:
        raise RuntimeError("no room for listeners\nsecond line")

    monkeypatch.setattr(CaptureProxy, "start", refuse)
    node = NodeProxy(NodeConfig(ProxyOptions(upstream="http://127.0.0.1:9"), None, os.urandom(32), "t", 8))
    node.start()
    assert node.ready() == "RuntimeError: no room for listeners"
    assert node.stop(1.0) == 0
